"""The HTTP shell of ``kvmesh bench serve``: streamed OpenAI requests, sent open-loop, timed.

``run_requests`` sends each prompt at its arrival offset (or later, when ``max_concurrency``
requests are already in flight) over one aiohttp session and returns a ``RequestRecord`` per
prompt, in prompt order, with every output chunk's arrival time. Any OpenAI-compatible server
works: the body holds only standard fields plus ``ignore_eos`` (vLLM, SGLang and kvmesh honour it;
``ignore_eos=False`` leaves it out) and whatever ``extra_body`` adds.

Failure kinds: ``http_<status>`` (any status but 200), ``timeout`` (``timeout_s`` for the whole
request ran out), ``connection_error`` (no response: refused, reset or closed before the status
line), ``incomplete`` (the stream stopped before ``[DONE]``: cut connection or early EOF),
``stream_error`` (an error event, or an event that is not JSON), ``empty_output`` (``[DONE]`` with
no output text at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.sse import SseDecoder, StreamUsage, read_chunk
from kvmesh.loadgen.workload import WorkloadPrompt

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class SseEndpoint:
    """Where and how to send: ``path`` is /v1/completions or /v1/chat/completions."""

    base_url: str
    model: str
    path: str = COMPLETIONS
    temperature: float = 0.0
    ignore_eos: bool = True
    send_ids: bool = True  # completions: send token ids, not text, when the prompt has both
    api_key: str | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.path not in (COMPLETIONS, CHAT):
            raise ValueError(f"endpoint must be {COMPLETIONS} or {CHAT}, got {self.path!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base URL must start with http:// or https://, got {self.base_url!r}")

    @property
    def is_chat(self) -> bool:
        return self.path == CHAT

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.path


def request_body(endpoint: SseEndpoint, prompt: WorkloadPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {"model": endpoint.model}
    if endpoint.is_chat:
        assert prompt.text is not None, "chat prompts are sent as text"
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.output_len
    else:
        use_ids = endpoint.send_ids or prompt.text is None
        body["prompt"] = list(prompt.token_ids) if use_ids else prompt.text
        body["max_tokens"] = prompt.output_len
    body.update(temperature=endpoint.temperature, stream=True)
    body["stream_options"] = {"include_usage": True}
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **endpoint.extra_body}


@dataclass(slots=True)
class _Progress:
    """What one request has seen so far (mutable while it streams)."""

    chunk_times: list[float] = field(default_factory=list)
    usage: StreamUsage | None = None
    response_id: str = ""
    has_response: bool = False
    is_done: bool = False


async def send_request(
    session: Any,
    endpoint: SseEndpoint,
    prompt: WorkloadPrompt,
    *,
    index: int = 0,
    arrival_s: float = 0.0,
    origin: float,
    timeout_s: float,
) -> RequestRecord:
    """One streamed request; times are seconds since ``origin`` (a ``time.perf_counter`` value).
    Returns a record for every outcome; raises only on cancellation."""
    import aiohttp

    clock = lambda: time.perf_counter() - origin
    seen = _Progress()
    send_s = clock()

    def record(error: str | None = None, detail: str = "") -> RequestRecord:
        usage = seen.usage
        return RequestRecord(
            index=index,
            arrival_s=arrival_s,
            send_s=send_s,
            end_s=clock(),
            prompt_len=usage.prompt_tokens if usage else prompt.input_len,
            output_len=prompt.output_len,
            num_output_tokens=usage.completion_tokens if usage else len(seen.chunk_times),
            chunk_times=tuple(seen.chunk_times),
            error=error,
            detail=detail,
            response_id=seen.response_id,
        )

    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    data = orjson.dumps(request_body(endpoint, prompt))
    try:
        async with session.post(
            endpoint.url, data=data, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            seen.has_response = True
            if response.status != 200:
                text = await response.text(errors="replace")
                return record(f"http_{response.status}", text[:300])
            decoder = SseDecoder()
            async for raw in response.content.iter_any():
                now = clock()
                for event in decoder.feed(raw):
                    chunk = read_chunk(event, endpoint.is_chat)
                    if chunk.error is not None:
                        return record("stream_error", chunk.error)
                    if chunk.is_token:
                        seen.chunk_times.append(now)
                    seen.usage = chunk.usage or seen.usage
                    seen.response_id = seen.response_id or chunk.response_id
                    seen.is_done = chunk.is_done
                    if seen.is_done:
                        break
                if seen.is_done:
                    break
    except TimeoutError:
        return record("timeout", f"no complete response within {timeout_s:g} s")
    except aiohttp.ClientPayloadError as exc:
        return record("incomplete", f"the stream was cut: {exc}")
    except (aiohttp.ClientError, OSError) as exc:
        kind = "incomplete" if seen.has_response else "connection_error"
        return record(kind, f"{type(exc).__name__}: {exc}")
    if not seen.is_done:
        return record("incomplete", "the stream ended without [DONE]")
    if not seen.chunk_times:
        return record("empty_output", "the stream finished without any output text")
    return record()


async def run_requests(
    endpoint: SseEndpoint,
    prompts: Sequence[WorkloadPrompt],
    arrivals: Sequence[float],
    *,
    timeout_s: float,
    max_concurrency: int | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``prompts[i]`` at ``arrivals[i]`` seconds after the start; returns the records (in
    prompt order) and the run's duration in seconds (start to the last request's end)."""
    import aiohttp

    assert len(prompts) == len(arrivals)
    assert max_concurrency is None or max_concurrency >= 1
    records: list[RequestRecord | None] = [None] * len(prompts)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # A fresh connection per request (as vllm bench serve's session per request): a kept-alive
    # one the server closes as it is taken again fails the request with "Server disconnected"
    # (llama-server closed 2 of 40 that way under --max-concurrency 8), which is no fault of
    # the server's serving.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        origin = time.perf_counter()

        async def one(i: int) -> None:
            async with gate or contextlib.nullcontext():
                records[i] = await send_request(
                    session,
                    endpoint,
                    prompts[i],
                    index=i,
                    arrival_s=arrivals[i],
                    origin=origin,
                    timeout_s=timeout_s,
                )
            if on_record is not None:
                on_record(records[i])

        async with asyncio.TaskGroup() as tasks:
            for i, at in enumerate(arrivals):
                delay = at - (time.perf_counter() - origin)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.create_task(one(i))
        duration_s = time.perf_counter() - origin
    assert all(r is not None for r in records)
    return [r for r in records if r is not None], duration_s
