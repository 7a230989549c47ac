"""The router's aiohttp application: OpenAI routes over a ``Dispatcher``.

Handlers stay thin: parse and validate (api), run on the mesh (dispatch), turn tokens into text
(output) and bodies or SSE chunks (responses). Errors before the first byte are JSON error bodies
with their status; errors after a stream has started are an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from kvmesh.services.router.api import (
    GenerateRequest,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.dispatch import Dispatcher, MeshRequest
from kvmesh.services.router.errors import (
    ApiError,
    AuthenticationError,
    InternalError,
    MethodNotAllowedError,
    ModelNotFoundError,
    OverloadedError,
    PayloadTooLargeError,
    RouteNotFoundError,
)
from kvmesh.services.router.http_limits import (
    ConnectionTable,
    GuardedSite,
    read_body,
    request_done_middleware,
)
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.model_info import ModelInfo
from kvmesh.services.router.openapi import openapi_document
from kvmesh.services.router.prompt import Prompt, tokenize
from kvmesh.services.router.responses import (
    SSE_DONE,
    ResponseBuilder,
    Usage,
    error_event,
    new_request_id,
    sse_event,
)
from kvmesh.services.router.schema import Model, ModelList
from kvmesh.services.router.shutdown import Shutdown
from kvmesh.shared import logs
from kvmesh.shared.metrics_exporter import exposition
from kvmesh.shared.service_errors import listen_error
from kvmesh.shared.subjects import Subjects
from kvmesh.shared.text import TextStream
from nats.aio.client import Client as NATS

log = logs.get_logger(__name__)

CLIENT_CLOSED = 499  # nginx's status for "the client went away"; only used in metrics
# Bodies larger than this are parsed, templated and tokenized in a worker thread, so that one
# huge prompt does not stall every other stream (and the heartbeats) on the event loop. Small
# ones stay inline: the thread hop would cost more than the work.
INLINE_BODY_BYTES = 64 * 1024


@dataclass(slots=True)
class Router:
    """State shared by the handlers of one router process."""

    config: RouterConfig
    model: ModelInfo
    nc: NATS
    subjects: Subjects  # the mesh's
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    started_at: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    dispatcher: Dispatcher = field(init=False)
    shutdown: Shutdown = field(default_factory=Shutdown)
    connections: ConnectionTable = field(init=False)  # what each HTTP client holds

    def __post_init__(self) -> None:
        self.dispatcher = Dispatcher(
            self.nc, self.subjects, self.config, self.metrics, model_spec=self.model.spec
        )
        self.connections = ConnectionTable(self.config.http_limits(), self.refuse_http)

    def refuse_http(self, reason: str) -> None:
        """A connection or a request refused by the HTTP limits (http_limits.py)."""
        self.metrics.http_refused.labels(reason).inc()

    async def stop(self, grace_s: float) -> None:
        """Stop taking requests (503) and let those in flight finish for ``grace_s``; then end
        the rest (streams: an error event and [DONE]; others: a 503) and abort their mesh work."""
        log.info("router stopping", in_flight=self.num_in_flight, grace_s=grace_s)
        self.dispatcher.is_stopping = True  # aborts from here on say why
        num_interrupted = await self.shutdown.stop(grace_s)
        if num_interrupted:
            log.warning("router stopped with requests in flight", interrupted=num_interrupted)

    # --- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    def _prepare(
        self, raw: bytes, parse: Callable[[dict, str], GenerateRequest]
    ) -> tuple[GenerateRequest, Prompt]:
        """Body bytes to a validated request and its token ids (pure CPU work)."""
        request = parse(parse_json_body(raw), self.model.name)
        return request, tokenize(request, self.model.tokenizer, self.model.max_model_len)

    async def _generate(
        self,
        http: web.Request,
        parse: Callable[[dict, str], GenerateRequest],
    ) -> web.StreamResponse:
        arrived_at = time.monotonic()
        status = 200
        response_id = ""  # the request's id everywhere on the mesh, once it is accepted
        try:
            self.shutdown.check_open()
            raw = await read_body(http, self.config.body_timeout_s, self.refuse_http)
            if len(raw) > INLINE_BODY_BYTES:
                request, prompt = await asyncio.to_thread(self._prepare, raw, parse)
            else:
                request, prompt = self._prepare(raw, parse)
            if self.num_in_flight >= self.config.max_concurrent_requests:
                raise OverloadedError(
                    f"the router holds {self.num_in_flight} requests, its limit "
                    "(--max-concurrent-requests); retry shortly",
                    retry_after_s=1.0,
                )
            self.num_in_flight += 1
            self.metrics.in_flight.set(self.num_in_flight)
            response_id = new_request_id(request.kind)
            try:
                with logs.request_context(response_id):
                    timer = RequestTimer(self.metrics, arrived_at)
                    if request.stream:
                        response, status = await self._stream(
                            http, request, prompt, timer, response_id
                        )
                        return response
                    return await self._complete(request, prompt, timer, response_id)
            finally:
                self.num_in_flight -= 1
                self.metrics.in_flight.set(self.num_in_flight)
        except ApiError as exc:
            status = exc.status
            if status >= 500:
                log.warning(
                    "request failed",
                    request_id=response_id or None,
                    path=http.path,
                    status=status,
                    error=exc.message,
                )
            return error_response(exc)
        except (asyncio.CancelledError, ConnectionError):
            status = CLIENT_CLOSED
            raise
        finally:
            self.metrics.requests.labels(http.path, str(status)).inc()
            if response_id:
                log.debug("request finished", request_id=response_id, status=status)

    async def _complete(
        self, request: GenerateRequest, prompt: Prompt, timer: RequestTimer, response_id: str
    ) -> web.Response:
        builder = ResponseBuilder.for_request(request, response_id)
        output = TextStream(self.model.tokenizer, prompt.prompt_ids, request.stop)
        async with (
            self.shutdown.guard(),
            self.dispatcher.open(response_id, prompt, timer) as mesh,
        ):
            finish_reason = await _relay(mesh, output, None)
        output.finish()
        timer.on_finish(finish_reason, len(prompt.prompt_ids), output.num_tokens)
        usage = _usage(prompt, output, mesh)
        return _json_response(builder.full(output.text, finish_reason, usage))

    async def _stream(
        self,
        http: web.Request,
        request: GenerateRequest,
        prompt: Prompt,
        timer: RequestTimer,
        response_id: str,
    ) -> tuple[web.StreamResponse, int]:
        """The SSE response and the status to count it under (an error after the first byte
        keeps the 200 status line but is counted as what it was)."""
        builder = ResponseBuilder.for_request(request, response_id)
        output = TextStream(self.model.tokenizer, prompt.prompt_ids, request.stop)
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )

        async def send_text(text: str, num_tokens: int = 0) -> None:
            # One chunk per step's tokens, even when they complete no character yet (a byte of a
            # multi-byte character, a possible stop-string prefix), as vLLM streams: clients
            # see every token when it is made, and token gaps are measurable.
            if text or num_tokens:
                await response.write(sse_event(builder.text_chunk(text)))

        status = 200
        try:
            async with (
                self.shutdown.guard(),
                self.dispatcher.open(response_id, prompt, timer) as mesh,
            ):
                # Placed: from here on errors go into the stream, not the status line.
                await response.prepare(http)
                role_chunk = builder.role_chunk()
                if role_chunk is not None:
                    await response.write(sse_event(role_chunk))
                finish_reason = await _relay(mesh, output, send_text)
            await send_text(output.finish())
            await response.write(sse_event(builder.finish_chunk(finish_reason)))
            if request.include_usage:
                usage = _usage(prompt, output, mesh)
                await response.write(sse_event(builder.usage_chunk(usage)))
            await response.write(SSE_DONE)
            timer.on_finish(finish_reason, len(prompt.prompt_ids), output.num_tokens)
        except ApiError as exc:
            if not response.prepared:
                raise
            status = exc.status
            log.warning("stream failed", status=status, error=exc.message)
            await response.write(error_event(exc))
            await response.write(SSE_DONE)
        await response.write_eof()
        return response, status

    # --- the rest ------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return _json_response(ModelList(object="list", data=[self._model_card()]))

    async def model_detail(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.model.name:
            raise ModelNotFoundError(
                f"the model {name!r} does not exist here; this router serves {self.model.name!r}",
                param="model",
            )
        return _json_response(self._model_card())

    def _model_card(self) -> Model:
        return Model(
            id=self.model.name,
            object="model",
            created=self.started_at,
            owned_by="kvmesh",
            max_model_len=self.model.max_model_len,
        )

    async def health(self, request: web.Request) -> web.Response:
        """Readiness: NATS connected and at least one decode (or colocated) worker ready."""
        if self.shutdown.is_stopping:
            return _json_response(
                {"status": "unavailable", "reason": "the router is shutting down"}, status=503
            )
        if not self.nc.is_connected:
            return _json_response(
                {"status": "unavailable", "reason": "not connected to NATS"}, status=503
            )
        now = time.monotonic()
        decode, prefill = self.dispatcher.decode_pool, self.dispatcher.prefill_pool
        counts = {
            "decode_workers": decode.num_ready(now),
            "prefill_workers": prefill.num_ready(now),
        }
        if counts["decode_workers"] == 0:
            alive = decode.num_alive(now)
            reason = (
                f"{alive} decode workers alive, all draining"
                if alive
                else "no decode worker heartbeats yet (starting, or none running)"
            )
            return _json_response(
                {"status": "unavailable", "reason": reason, **counts},
                status=503,
                headers={"Retry-After": "1"},
            )
        return _json_response({"status": "ok", "model": self.model.name, **counts})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = exposition(self.metrics.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def openapi(self, request: web.Request) -> web.Response:
        return _json_response(openapi_document(self.model.name))


def _usage(prompt: Prompt, output: TextStream, mesh: MeshRequest) -> Usage:
    """The request's token counts, with the accepted drafts among the tokens the client got."""
    accepted = min(mesh.num_accepted_drafts, output.num_tokens)
    return Usage.of(len(prompt.prompt_ids), output.num_tokens, accepted)


async def _relay(
    mesh: MeshRequest,
    output: TextStream,
    send_text: Callable[[str, int], Awaitable[None]] | None,
) -> str:
    """Feed the mesh's tokens into ``output`` (and out, when streaming) until the end; returns
    the finish reason. A stop string ends the request here and aborts the rest of it."""
    async with aclosing(mesh.events()) as events:
        async for event in events:
            text = output.add(event.token_ids)
            if send_text is not None:  # after a stop string: its last text only
                await send_text(text, 0 if output.is_stopped else len(event.token_ids))
            if output.is_stopped:
                await mesh.abort("stop string")
                return "stop"
            if event.finish_reason is not None:
                return event.finish_reason
    raise AssertionError("events() ended without a finish_reason")


def error_response(exc: ApiError) -> web.Response:
    return _json_response(exc.body(), status=exc.status, headers=exc.headers())


def _json_response(
    payload: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(payload),
        status=status,
        headers={"Content-Type": "application/json", **(headers or {})},
    )


@web.middleware
async def _error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc)
    except web.HTTPNotFound:
        return error_response(
            RouteNotFoundError(f"no route {request.method} {request.path}; see /openapi.json")
        )
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(
            PayloadTooLargeError(
                f"the request body is larger than this router accepts ({exc.text}); raise "
                "--max-body-mb or send less"
            )
        )
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(
            MethodNotAllowedError(
                f"{request.method} is not allowed on {request.path}; use {allowed}"
            )
        )
    except (asyncio.CancelledError, ConnectionError, web.HTTPException):
        raise
    except Exception:
        log.exception("unhandled error", path=request.path)
        return error_response(InternalError("internal error in the router; see its log"))


def _api_key_middleware(api_key: str | None):
    """With an API key, every /v1 route needs ``Authorization: Bearer <key>`` (health, metrics
    and the OpenAPI document stay open, as in vLLM)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    @web.middleware
    async def check_api_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if expected is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise AuthenticationError(
                    "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                    "the router was started with (--api-key / KVMESH_API_KEY)"
                )
        return await handler(request)

    return check_api_key


def build_app(router: Router) -> web.Application:
    app = web.Application(
        middlewares=[
            request_done_middleware(router.connections),
            _error_middleware,
            _api_key_middleware(router.config.api_key),
        ],
        client_max_size=int(router.config.max_body_mb * 1024 * 1024),
    )
    app.add_routes(
        [
            web.post("/v1/completions", router.completions),
            web.post("/v1/chat/completions", router.chat_completions),
            web.get("/v1/models", router.models),
            web.get("/v1/models/{model}", router.model_detail),
            web.get("/health", router.health),
            web.get("/metrics", router.metrics_text),
            web.get("/openapi.json", router.openapi),
        ]
    )
    return app


@asynccontextmanager
async def serve_http(
    app: web.Application, host: str, port: int, connections: ConnectionTable
) -> AsyncIterator[int]:
    """Serve ``app`` on host:port for the duration of the block; yields the bound port. Each
    connection goes through ``connections``' limits (services/router/http_limits.py).

    Handlers are cancelled when their client disconnects, so a waiting request aborts its work
    on the mesh instead of running to the end for nobody."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = GuardedSite(runner, host, port, connections)
        try:
            await site.start()
        except OSError as exc:  # a busy port, a foreign address: one line says what to change
            raise listen_error(host, port, exc) from None
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()
