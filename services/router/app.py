"""The router's aiohttp application: its state (``Router``) and its routes over a ``Dispatcher``.

Handlers stay thin: the generate routes are generation.py's (parse and validate: api; run on
the mesh: dispatch; answer whole or streamed: sse_response), the others answer here from the
router's state. Errors before the first byte are JSON error bodies with their status; errors
after a stream has started are an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web
from kvmesh.services.router.access_log import access_log_middleware
from kvmesh.services.router.api import parse_chat, parse_completion, parse_json_body
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.dispatch import Dispatcher
from kvmesh.services.router.errors import ModelNotFoundError
from kvmesh.services.router.generation import generate
from kvmesh.services.router.http_limits import (
    ConnectionTable,
    body_limit_middleware,
    read_body,
    request_done_middleware,
)
from kvmesh.services.router.http_server import (
    api_key_middleware,
    error_middleware,
    json_response,
    tenant_of,
)
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.model_info import ModelInfo
from kvmesh.services.router.openapi import ROUTES, openapi_document
from kvmesh.services.router.response_bodies import Model, ModelList
from kvmesh.services.router.shutdown import Shutdown
from kvmesh.services.router.tenants import Tenants
from kvmesh.services.router.timings import TimingLog
from kvmesh.services.router.tokens_api import detokenize_body, tokenize_body
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.config.open_files import open_file_limit
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from kvmesh.shared.obs.metrics_exporter import exposition
from kvmesh.shared.text.schema_limits import SchemaLimits
from kvmesh.shared.text.tool_calls import default_parser
from nats.aio.client import Client as NATS

log = logs.get_logger(__name__)


@dataclass(slots=True)
class Router:
    """State shared by the handlers of one router process."""

    config: RouterConfig
    model: ModelInfo
    nc: NATS
    subjects: Subjects  # the mesh's
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    timings: TimingLog = field(default_factory=TimingLog)  # GET /v1/kvmesh/timings
    started_at: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    dispatcher: Dispatcher = field(init=False)
    shutdown: Shutdown = field(default_factory=Shutdown)
    hearing: Hearing | None = None  # the NATS link's outages (shared/bus/hearing.py)
    connections: ConnectionTable = field(init=False)  # what each HTTP client holds
    tenants: Tenants = field(init=False)  # the API keys (tenants.py)
    salts_by_api_key: bool = field(init=False)  # --salt-by-api-key, its default resolved
    schema_limits: SchemaLimits = field(init=False)  # what a structured output may hold
    tool_parser: str = field(init=False)  # --tool-call-parser, its default resolved

    def __post_init__(self) -> None:
        self.dispatcher = Dispatcher(
            self.nc,
            self.subjects,
            self.config,
            self.metrics,
            model_spec=self.model.spec,
            hearing=self.hearing,
            model_len=self.model.max_model_len,
        )
        # never more connections than descriptors (issue 40: EMFILE at a 1,024 limit)
        limits = self.config.http_limits().within_open_files(open_file_limit())
        self.connections = ConnectionTable(limits, self.refuse_http)
        self.tenants = Tenants(self.config.read_api_keys(), self.config.admin_api_key)
        salt_by_key = self.config.salt_by_api_key
        self.salts_by_api_key = self.tenants.num_keys > 1 if salt_by_key is None else salt_by_key
        self.schema_limits = self.config.schema_limits()
        parser = self.config.tool_call_parser
        self.tool_parser = (
            default_parser(self.model.tokenizer.chat_template) if parser == "auto" else parser
        )

    def refuse_http(self, reason: str) -> None:
        """A connection or a request refused by the HTTP limits (http_limits.py)."""
        self.metrics.http_refused.labels(reason).inc()

    @property
    def max_body_bytes(self) -> int:
        return int(self.config.max_body_mb * 1024 * 1024)

    async def read_body(self, request: web.Request) -> bytes:
        """A POST route's body, within --body-timeout-s (http_limits.read_body)."""
        return await read_body(request, self.config.body_timeout_s, self.refuse_http)

    async def stop(self, grace_s: float) -> None:
        """Stop taking requests (503) and let those in flight finish for ``grace_s``; then end
        the rest (streams: an error event and [DONE]; others: a 503) and abort their mesh work."""
        log.info("router stopping", in_flight=self.num_in_flight, grace_s=grace_s)
        self.dispatcher.is_stopping = True  # aborts from here on say why
        num_interrupted = await self.shutdown.stop(grace_s)
        if num_interrupted:
            log.warning("router stopped with requests in flight", interrupted=num_interrupted)

    # --- generation: generation.py ------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await generate(self, request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await generate(self, request, parse_chat)

    # --- the rest ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return json_response(ModelList(object="list", data=[self._model_card()]))

    async def model_detail(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model.name:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist here; this router serves {self.model.name!r}",
                param="model",
            )
        return json_response(self._model_card())

    def _model_card(self) -> Model:
        return Model(
            id=self.model.name,
            object="model",
            created=self.started_at,
            owned_by="kvmesh",
            max_model_len=self.max_model_len(),
        )

    def max_model_len(self) -> int:
        """The context a request can really use: the model's, or the largest decode worker's KV
        pool when that is smaller (pool_capacity.py)."""
        return self.dispatcher.capacity.context(time.monotonic())

    async def tokenize(self, request: web.Request) -> web.Response:
        body = parse_json_body(await self.read_body(request))
        answer = tokenize_body(
            body, self.model.name, self.model.tokenizer, self.max_model_len(), self.tool_parser
        )
        return json_response(answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        body = parse_json_body(await self.read_body(request))
        return json_response(detokenize_body(body, self.model.name, self.model.tokenizer))

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: NATS connected and at least one decode (or colocated) worker ready."""
        if self.shutdown.is_stopping:
            return json_response(
                {"status": "unavailable", "reason": "the router is shutting down"}, status=503
            )
        if not self.nc.is_connected:
            return json_response(
                {"status": "unavailable", "reason": "not connected to NATS"}, status=503
            )
        now = time.monotonic()
        decode, prefill = self.dispatcher.decode_pool, self.dispatcher.prefill_pool
        counts = {
            "decode_workers": decode.num_ready(now),
            "prefill_workers": prefill.num_ready(now),
        }
        if counts["decode_workers"] == 0:
            alive, starting = decode.num_alive(now), decode.starting(now)
            reason = (
                f"decode workers starting (loading their model): {', '.join(starting)}"
                if starting
                else f"{alive} decode workers alive, all draining"
                if alive
                else "no decode worker heartbeats yet (starting, or none running)"
            )
            return json_response(
                {"status": "unavailable", "reason": reason, **counts},
                status=503,
                headers={"Retry-After": "1"},
            )
        if missing := self.dispatcher.prefill_queue.missing:  # every prefill job fails
            return json_response(
                {"status": "unavailable", "reason": missing, **counts},
                status=503,
                headers={"Retry-After": "5"},
            )
        if degraded := self.dispatcher.degraded(now):  # it serves, without them
            return json_response(
                {"status": "degraded", "reason": f"degraded: {degraded}", **counts}
                | {"model": self.model.name}
            )
        return json_response({"status": "ok", "model": self.model.name, **counts})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = exposition(self.metrics.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_document(self.model.name))

    async def request_timings(self, request: web.Request) -> web.Response:
        """The latest finished requests' time to first token by stage (``timings.py``): every
        tenant's for the admin key (or an open router), the caller's own for another key."""
        tenant = tenant_of(request)
        return json_response(self.timings.to_json(None if tenant.is_admin else tenant.name))


def build_app(router: Router) -> web.Application:
    app = web.Application(
        middlewares=[
            request_done_middleware(router.connections),
            access_log_middleware(),  # outside error_middleware: it sees the answer sent
            error_middleware,
            body_limit_middleware(router.max_body_bytes, router.refuse_http),
            api_key_middleware(router.tenants),
        ],
        client_max_size=router.max_body_bytes,
    )
    # the same list makes /openapi.json (openapi.py); web.get also answers HEAD
    add = {"GET": web.get, "POST": web.post}
    app.add_routes([add[r.method](r.path, getattr(router, r.handler)) for r in ROUTES])
    return app
