"""A streamed answer: the SSE response of a generate request, chunks sent as the mesh's tokens
arrive.

The status line (200) goes out once the request is placed; an error after that is an SSE error
event and ``[DONE]``, counted under its own status. The client's send buffer is bounded: one
that does not read is cut off, never waited for (client_stream.py). A resumable stream (one
choice, no tools) carries event ids, and a resumed one sends only the events past the client's
(stream_ids.py, stream_resume.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web
from kvmesh.services.router.access_log import CLIENT_CLOSED
from kvmesh.services.router.api import GenerateRequest
from kvmesh.services.router.choices import Choice
from kvmesh.services.router.client_stream import ClientStream
from kvmesh.services.router.errors import ApiError, ClientGoneError
from kvmesh.services.router.mesh_relay import new_choices, relay, usage_of
from kvmesh.services.router.metrics import RequestTimer
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.responses import (
    Logprobs,
    ResponseBuilder,
    error_event,
    sse_done,
    sse_event,
)
from kvmesh.services.router.stream_ids import (
    DONE,
    ERROR,
    FINISH,
    TAIL,
    TOKENS,
    USAGE,
    EventIds,
    Resume,
)
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.router.app import Router

log = logs.get_logger(__name__)


def is_resumable(request: GenerateRequest, prompt: Prompt) -> bool:
    """Whether a stream of ``request`` carries event ids, so a client can resume it through
    another router (docs/faults.md): one choice, its text not read for tool calls (whose deltas
    depend on how the tokens were grouped)."""
    return prompt.sampling.n == 1 and request.tools is None


async def stream_response(
    router: Router,
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
    choices = new_choices(request, prompt, router.model.tokenizer, router.tool_parser)
    # a resumable stream's events carry ids; a resumed one sends those past the client's
    ids = None
    if is_resumable(request, prompt):
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
        max_buffer_bytes=router.config.client_send_buffer_kb * 1024,
        write_timeout_s=router.config.client_write_timeout_s,
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
                    router.shutdown.guard(),
                    router.dispatcher.open(response_id, prompt, timer, resume) as mesh,
                ):
                    # Placed: from here on errors go into the stream, not the status line.
                    await response.prepare(http)
                    for choice in choices:
                        role_chunk = builder.role_chunk(choice.index)
                        if role_chunk is not None:
                            emit(role_chunk, TOKENS)
                    await relay(mesh, choices, send)
                usage = usage_of(prompt, choices, mesh)
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
            router.metrics.client_cutoffs.labels(exc.cutoff).inc()
    return response, status
