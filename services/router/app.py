"""The router's aiohttp application: OpenAI routes over a ``Dispatcher``.

Handlers stay thin: parse and validate (api), run on the mesh (dispatch), turn tokens into text
(output) and bodies or SSE chunks (responses). Errors before the first byte are JSON error bodies
with their status; errors after a stream has started are an SSE error event and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import msgspec
from aiohttp import web
from kvmesh.services.router import access_log, structured
from kvmesh.services.router.access_log import access_log_middleware
from kvmesh.services.router.api import (
    GenerateRequest,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from kvmesh.services.router.choices import Choice
from kvmesh.services.router.client_stream import ClientStream
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.dispatch import Dispatcher
from kvmesh.services.router.errors import (
    ApiError,
    ClientGoneError,
    InvalidRequestError,
    MeshError,
    ModelNotFoundError,
    OverloadedError,
)
from kvmesh.services.router.http_limits import (
    ConnectionTable,
    body_limit_middleware,
    read_body,
    request_done_middleware,
)
from kvmesh.services.router.http_server import (
    api_key_middleware,
    error_middleware,
    error_response,
    json_response,
    tenant_of,
)
from kvmesh.services.router.logprobs import LogprobsBuilder, prompt_logprobs
from kvmesh.services.router.mesh_request import MeshRequest
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.model_info import ModelInfo
from kvmesh.services.router.openapi import ROUTES, openapi_document
from kvmesh.services.router.prompt import Prompt, tokenize
from kvmesh.services.router.response_bodies import Model, ModelList
from kvmesh.services.router.responses import (
    Logprobs,
    ResponseBuilder,
    Usage,
    error_event,
    new_request_id,
    sse_done,
    sse_event,
)
from kvmesh.services.router.shutdown import Shutdown
from kvmesh.services.router.stream_ids import (
    DONE,
    ERROR,
    FINISH,
    TAIL,
    TOKENS,
    USAGE,
    EventId,
    EventIds,
    Resume,
)
from kvmesh.services.router.tenants import Tenant, Tenants, cache_salt
from kvmesh.services.router.timings import TimingLog
from kvmesh.services.router.tokens_api import detokenize_body, tokenize_body
from kvmesh.services.router.tools import check_tools
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.config.open_files import open_file_limit
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from kvmesh.shared.obs.metrics_exporter import exposition
from kvmesh.shared.text.schema_limits import SchemaLimits
from kvmesh.shared.text.tool_calls import default_parser
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

    # --- generation ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    def _prepare(
        self, raw: bytes, parse: Callable[[dict, str], GenerateRequest], tenant: Tenant
    ) -> tuple[GenerateRequest, Prompt]:
        """Body bytes to a validated request and its token ids (pure CPU work)."""
        request = parse(parse_json_body(raw), self.model.name)
        tenant_salt = tenant.name if self.salts_by_api_key else ""
        salt = cache_salt(tenant_salt, request.sampling.cache_salt, request.prompt_cache_key)
        if salt != request.sampling.cache_salt:
            sampling = msgspec.structs.replace(request.sampling, cache_salt=salt)
            request = dataclasses.replace(request, sampling=sampling)
        pool = self.dispatcher.capacity.max_tokens(time.monotonic())
        prompt = tokenize(
            request, self.model.tokenizer, self.model.max_model_len, pool, self.tool_parser
        )
        if request.tools is not None:
            check_tools(request.tools, self.schema_limits)
        if prompt.sampling.structured_outputs is not None:
            structured.check(
                prompt.sampling.structured_outputs, request.structured_param, self.schema_limits
            )
        return request, prompt

    async def _generate(
        self,
        http: web.Request,
        parse: Callable[[dict, str], GenerateRequest],
    ) -> web.StreamResponse:
        arrived_at = time.monotonic()
        status = 200
        response_id = ""  # the request's id everywhere on the mesh, once it is accepted
        access = access_log.note()
        timer: RequestTimer | None = None
        try:
            self.shutdown.check_open()
            raw = await self.read_body(http)
            tenant = tenant_of(http)
            if len(raw) > INLINE_BODY_BYTES or structured.may_ask(raw) or b'"tools"' in raw:
                request, prompt = await asyncio.to_thread(self._prepare, raw, parse, tenant)
            else:
                request, prompt = self._prepare(raw, parse, tenant)
            access.prompt_tokens = len(prompt.prompt_ids)
            last_event_id = http.headers.get("Last-Event-ID")
            resume = None
            if last_event_id is not None:
                resume = _resume_of(last_event_id, request, prompt)
            if self.num_in_flight >= self.config.max_concurrent_requests:
                raise OverloadedError(
                    f"the router holds {self.num_in_flight} requests, its limit "
                    "(--max-concurrent-requests); retry shortly",
                    retry_after_s=1.0,
                )
            self.num_in_flight += 1
            self.metrics.in_flight.set(self.num_in_flight)
            response_id = resume.last.request_id if resume else new_request_id(request.kind)
            access.request_id = response_id
            try:
                with logs.request_context(response_id):
                    timer = RequestTimer(
                        self.metrics,
                        arrived_at,
                        log=self.timings,
                        request_id=response_id,
                        tenant=tenant.name,
                    )
                    if request.stream:
                        response, status = await self._stream(
                            http, request, prompt, timer, response_id, resume
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
            access.status = status
            if timer is not None:
                access.completion_tokens = timer.num_output_tokens
                if timer.first_token_at is not None:
                    access.ttft_s = timer.first_token_at - arrived_at
            if response_id:
                log.debug("request finished", request_id=response_id, status=status)

    async def _complete(
        self, request: GenerateRequest, prompt: Prompt, timer: RequestTimer, response_id: str
    ) -> web.Response:
        builder = ResponseBuilder.for_request(request, response_id)
        choices = self._choices(request, prompt)
        async with (
            self.shutdown.guard(),
            self.dispatcher.open(response_id, prompt, timer) as mesh,
        ):
            await _relay(mesh, choices, None)
        try:
            results = [choice.result() for choice in choices]
        except ValueError as exc:
            raise MeshError(f"the mesh's answer is incomplete: {exc}") from None
        usage = _usage(prompt, choices, mesh)
        timer.on_finish(results[0].finish_reason, len(prompt.prompt_ids), usage.completion_tokens)
        scored = None
        if request.returns_prompt_logprobs:
            if choices[0].prompt_scored is None:
                raise MeshError("the mesh sent no prompt logprobs")
            lps = LogprobsBuilder(self.model.tokenizer, is_chat=False)
            scored = prompt_logprobs(lps, prompt.prompt_ids, choices[0].prompt_scored)
        return json_response(builder.full(results, usage, scored))

    def _choices(self, request: GenerateRequest, prompt: Prompt) -> list[Choice]:
        is_chat = request.kind == "chat"
        tokenizer, sampling = self.model.tokenizer, prompt.sampling
        echo_text = None
        if request.echo:
            echo_text = request.prompt_text
            if echo_text is None:
                echo_text = tokenizer.decode(prompt.prompt_ids)
        tool_format = request.tools.output_format(self.tool_parser) if request.tools else None
        return [
            Choice.new(i, tokenizer, prompt.prompt_ids, sampling, is_chat, echo_text, tool_format)
            for i in range(sampling.n)
        ]

    async def _stream(
        self,
        http: web.Request,
        request: GenerateRequest,
        prompt: Prompt,
        timer: RequestTimer,
        response_id: str,
        resume: Resume | None = None,
    ) -> tuple[web.StreamResponse, int]:
        """The SSE response and the status to count it under (an error after the first byte
        keeps the 200 status line but is counted as what it was). ``resume``: the client
        resumes this stream after the event it names (stream_ids.py, stream_resume.py)."""
        builder = ResponseBuilder.for_request(request, response_id)
        choices = self._choices(request, prompt)
        # a resumable stream's events carry ids; a resumed one sends those past the client's
        ids = None
        if _is_resumable(request, prompt):
            ids = EventIds(response_id, resume.last.point if resume else (-1, 0))

        def event_id(slot: int) -> str | None:
            """The id of the stream's next event (slot: stream_ids.py), "" when the client has
            that event already (a resumed stream), None when the stream carries no ids."""
            if ids is None:
                return None
            next_id = ids.next(choices[0].output.num_tokens, slot)
            return "" if next_id is None else str(next_id)

        def emit(payload, slot: int) -> None:
            eid = event_id(slot)
            if eid != "":
                client.send(sse_event(payload, eid))

        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )

        # Bounded: a client that does not read is cut off, never waited for (client_stream.py).
        client = ClientStream(
            http,
            response,
            max_buffer_bytes=self.config.client_send_buffer_kb * 1024,
            write_timeout_s=self.config.client_write_timeout_s,
        )

        async def send(choice: Choice, text: str, num_tokens: int, logprobs: Logprobs | None):
            # One chunk per step's tokens, even when they complete no character yet (a byte of a
            # multi-byte character, a possible stop-string prefix), as vLLM streams: clients
            # see every token when it is made, and token gaps are measurable.
            if choice.tool_calls is not None:
                if choice.is_done:
                    text += choice.output.finish()
                send_tools(choice, choice.tool_deltas(text), num_tokens, logprobs)
            else:
                if text or num_tokens:
                    emit(builder.text_chunk(text, choice.index, logprobs), TOKENS)
                if choice.is_done:
                    tail = choice.output.finish()
                    if tail:
                        emit(builder.text_chunk(tail, choice.index), TAIL)
            if choice.is_done:
                finish_reason = choice.api_finish_reason
                assert finish_reason is not None
                emit(builder.finish_chunk(finish_reason, choice.index), FINISH)

        def send_tools(
            choice: Choice, deltas: list, num_tokens: int, logprobs: Logprobs | None
        ) -> None:
            # a chunk per step as without tools; the step's logprobs ride on its first chunk
            if not deltas and (num_tokens or logprobs is not None):
                deltas = [""]
            for delta in deltas:
                if isinstance(delta, str):
                    chunk = builder.text_chunk(delta, choice.index, logprobs)
                else:
                    chunk = builder.tool_chunk(delta, choice.index)
                    if logprobs is not None:
                        chunk.choices[0].logprobs = logprobs
                logprobs = None
                client.send(sse_event(chunk))

        status = 200
        try:
            async with client:
                try:
                    async with (
                        self.shutdown.guard(),
                        self.dispatcher.open(response_id, prompt, timer, resume) as mesh,
                    ):
                        # Placed: from here on errors go into the stream, not the status line.
                        await response.prepare(http)
                        for choice in choices:
                            role_chunk = builder.role_chunk(choice.index)
                            if role_chunk is not None:
                                emit(role_chunk, TOKENS)
                        await _relay(mesh, choices, send)
                    usage = _usage(prompt, choices, mesh)
                    if request.include_usage:
                        emit(builder.usage_chunk(usage), USAGE)
                    done_id = event_id(DONE)
                    await client.finish(sse_done(done_id) if done_id != "" else b"")
                    finish_reason = choices[0].finish_reason
                    assert finish_reason is not None
                    timer.on_finish(finish_reason, len(prompt.prompt_ids), usage.completion_tokens)
                except ApiError as exc:
                    if not response.prepared:
                        raise
                    status = exc.status
                    log.warning("stream failed", status=status, error=exc.message)
                    error_id = event_id(ERROR)
                    if error_id != "":
                        client.send(error_event(exc, error_id))
                    done_id = event_id(DONE)
                    await client.finish(sse_done(done_id) if done_id != "" else b"")
        except ClientGoneError as exc:  # its mesh work is aborted, its connection dropped
            status = CLIENT_CLOSED
            if exc.cutoff:
                self.metrics.client_cutoffs.labels(exc.cutoff).inc()
        return response, status

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


def _is_resumable(request: GenerateRequest, prompt: Prompt) -> bool:
    """Whether a stream of ``request`` carries event ids, so a client can resume it through
    another router (docs/faults.md): one choice, its text not read for tool calls (whose deltas
    depend on how the tokens were grouped)."""
    return prompt.sampling.n == 1 and request.tools is None


def _resume_of(last_event_id: str, request: GenerateRequest, prompt: Prompt) -> Resume:
    """The stream a request with ``Last-Event-ID`` resumes; InvalidRequestError when it cannot
    be one (not streamed, or a stream that carries no ids)."""
    if not request.stream:
        raise InvalidRequestError(
            "Last-Event-ID resumes a stream: send the same request with stream: true",
            param="Last-Event-ID",
        )
    if not _is_resumable(request, prompt):
        raise InvalidRequestError(
            "a stream of n > 1 choices or with tools carries no event ids and cannot be "
            "resumed: send the request again without Last-Event-ID",
            param="Last-Event-ID",
        )
    last = EventId.parse(last_event_id, request.kind)
    return Resume(last, wants_logprobs=prompt.sampling.logprobs is not None)


def _usage(prompt: Prompt, choices: list[Choice], mesh: MeshRequest) -> Usage:
    """The request's token counts, with the accepted drafts among the tokens the client got."""
    num_tokens = sum(choice.output.num_tokens for choice in choices)
    accepted = min(mesh.num_accepted_drafts, num_tokens)
    return Usage.of(len(prompt.prompt_ids), num_tokens, accepted)


async def _relay(
    mesh: MeshRequest,
    choices: list[Choice],
    send: Callable[[Choice, str, int, Logprobs | None], Awaitable[None]] | None,
) -> None:
    """Feed the mesh's tokens into their choices (and out, when streaming) until every choice
    is done. A stop string ends its choice here; once every choice is done the rest of the
    request is aborted."""
    async with aclosing(mesh.events()) as events:
        async for event in events:
            if event.index >= len(choices):
                raise MeshError(
                    f"a decode worker sent choice {event.index} of a request of {len(choices)}"
                )
            if event.prompt_logprobs:  # the prompt's, on choice 0's first event
                for c in choices:
                    c.prompt_scored = list(event.prompt_logprobs)
            choice = choices[event.index]
            if choice.is_done:  # a stop string the router saw first; the mesh ends it too
                continue
            try:
                text, logprobs = choice.add(event)
            except ValueError as exc:
                raise MeshError(f"a decode worker sent a malformed token event: {exc}") from None
            if send is not None:  # after a stop string: its last text only
                stopped = choice.output.is_stopped
                await send(choice, text, 0 if stopped else len(event.token_ids), logprobs)
            if all(c.is_done for c in choices):
                await mesh.abort("stop string")  # nothing to stop when the mesh finished them
                return
    raise AssertionError("events() ended before every choice finished")


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
