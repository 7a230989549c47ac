"""The generate routes (``POST /v1/completions``, ``/v1/chat/completions``): one request from
its body to its answer.

A body is parsed and validated (api.py), salted for its tenant, templated and tokenized
(prompt.py) and checked (tools, structured outputs): a large one in a worker thread, so that
one huge prompt does not stall every other stream (and the heartbeats) on the event loop. The
request is then admitted within ``--max-concurrent-requests``, run on the mesh (dispatch.py)
and answered whole here, or streamed (sse_response.py). An error before the first byte is a
JSON error body with its status (http_server.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web
from kvmesh.services.router import access_log, structured
from kvmesh.services.router.api import GenerateRequest, parse_json_body
from kvmesh.services.router.errors import (
    ApiError,
    InvalidRequestError,
    MeshError,
    OverloadedError,
)
from kvmesh.services.router.http_server import error_response, json_response, tenant_of
from kvmesh.services.router.logprobs import LogprobsBuilder, prompt_logprobs
from kvmesh.services.router.mesh_relay import new_choices, relay, usage_of
from kvmesh.services.router.metrics import RequestTimer
from kvmesh.services.router.prompt import Prompt, tokenize
from kvmesh.services.router.responses import ResponseBuilder, new_request_id
from kvmesh.services.router.sse_response import is_resumable, stream_response
from kvmesh.services.router.stream_ids import EventId, Resume
from kvmesh.services.router.tenants import Tenant, cache_salt
from kvmesh.services.router.tools import check_tools
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.router.app import Router

log = logs.get_logger(__name__)

# Bodies larger than this are parsed, templated and tokenized in a worker thread, so that one
# huge prompt does not stall every other stream (and the heartbeats) on the event loop. Small
# ones stay inline: the thread hop would cost more than the work.
INLINE_BODY_BYTES = 64 * 1024

Parse = Callable[[dict, str], GenerateRequest]  # api.parse_completion or api.parse_chat


async def generate(router: Router, http: web.Request, parse: Parse) -> web.StreamResponse:
    """Answer one generate request, counted in the router's metrics and its access log."""
    arrived_at = time.monotonic()
    status = 200
    response_id = ""  # the request's id everywhere on the mesh, once it is accepted
    access = access_log.note()
    timer: RequestTimer | None = None
    try:
        router.shutdown.check_open()
        raw = await router.read_body(http)
        tenant = tenant_of(http)
        if len(raw) > INLINE_BODY_BYTES or structured.may_ask(raw) or b'"tools"' in raw:
            request, prompt = await asyncio.to_thread(prepare, router, raw, parse, tenant)
        else:
            request, prompt = prepare(router, raw, parse, tenant)
        access.prompt_tokens = len(prompt.prompt_ids)
        last_event_id = http.headers.get("Last-Event-ID")
        resume = None
        if last_event_id is not None:
            resume = resume_of(last_event_id, request, prompt)
        if router.num_in_flight >= router.config.max_concurrent_requests:
            raise OverloadedError(
                f"the router holds {router.num_in_flight} requests, its limit "
                "(--max-concurrent-requests); retry shortly",
                retry_after_s=1.0,
            )
        router.num_in_flight += 1
        router.metrics.in_flight.set(router.num_in_flight)
        response_id = resume.last.request_id if resume else new_request_id(request.kind)
        access.request_id = response_id
        try:
            with logs.request_context(response_id):
                timer = RequestTimer(
                    router.metrics,
                    arrived_at,
                    log=router.timings,
                    request_id=response_id,
                    tenant=tenant.name,
                )
                if request.stream:
                    response, status = await stream_response(
                        router, http, request, prompt, timer, response_id, resume
                    )
                    return response
                return await complete(router, request, prompt, timer, response_id)
        finally:
            router.num_in_flight -= 1
            router.metrics.in_flight.set(router.num_in_flight)
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
        status = access_log.CLIENT_CLOSED
        raise
    finally:
        router.metrics.requests.labels(http.path, str(status)).inc()
        access.status = status
        if timer is not None:
            access.completion_tokens = timer.num_output_tokens
            if timer.first_token_at is not None:
                access.ttft_s = timer.first_token_at - arrived_at
        if response_id:
            log.debug("request finished", request_id=response_id, status=status)


def prepare(
    router: Router, raw: bytes, parse: Parse, tenant: Tenant
) -> tuple[GenerateRequest, Prompt]:
    """Body bytes to a validated request and its token ids (pure CPU work)."""
    request = parse(parse_json_body(raw), router.model.name)
    tenant_salt = tenant.name if router.salts_by_api_key else ""
    salt = cache_salt(tenant_salt, request.sampling.cache_salt, request.prompt_cache_key)
    if salt != request.sampling.cache_salt:
        sampling = msgspec.structs.replace(request.sampling, cache_salt=salt)
        request = dataclasses.replace(request, sampling=sampling)
    pool = router.dispatcher.capacity.max_tokens(time.monotonic())
    prompt = tokenize(
        request, router.model.tokenizer, router.model.max_model_len, pool, router.tool_parser
    )
    if request.tools is not None:
        check_tools(request.tools, router.schema_limits)
    if prompt.sampling.structured_outputs is not None:
        structured.check(
            prompt.sampling.structured_outputs, request.structured_param, router.schema_limits
        )
    return request, prompt


async def complete(
    router: Router,
    request: GenerateRequest,
    prompt: Prompt,
    timer: RequestTimer,
    response_id: str,
) -> web.Response:
    """The whole answer of a request that does not stream."""
    builder = ResponseBuilder.for_request(request, response_id)
    choices = new_choices(request, prompt, router.model.tokenizer, router.tool_parser)
    async with (
        router.shutdown.guard(),
        router.dispatcher.open(response_id, prompt, timer) as mesh,
    ):
        await relay(mesh, choices, None)
    try:
        results = [choice.result() for choice in choices]
    except ValueError as exc:
        raise MeshError(f"the mesh's answer is incomplete: {exc}") from None
    usage = usage_of(prompt, choices, mesh)
    timer.on_finish(results[0].finish_reason, len(prompt.prompt_ids), usage.completion_tokens)
    scored = None
    if request.returns_prompt_logprobs:
        if choices[0].prompt_scored is None:
            raise MeshError("the mesh sent no prompt logprobs")
        lps = LogprobsBuilder(router.model.tokenizer, is_chat=False)
        scored = prompt_logprobs(lps, prompt.prompt_ids, choices[0].prompt_scored)
    return json_response(builder.full(results, usage, scored))


def resume_of(last_event_id: str, request: GenerateRequest, prompt: Prompt) -> Resume:
    """The stream a request with ``Last-Event-ID`` resumes; InvalidRequestError when it cannot
    be one (not streamed, or a stream that carries no ids)."""
    if not request.stream:
        raise InvalidRequestError(
            "Last-Event-ID resumes a stream: send the same request with stream: true",
            param="Last-Event-ID",
        )
    if not is_resumable(request, prompt):
        raise InvalidRequestError(
            "a stream of n > 1 choices or with tools carries no event ids and cannot be "
            "resumed: send the request again without Last-Event-ID",
            param="Last-Event-ID",
        )
    last = EventId.parse(last_event_id, request.kind)
    return Resume(last, wants_logprobs=prompt.sampling.logprobs is not None)
