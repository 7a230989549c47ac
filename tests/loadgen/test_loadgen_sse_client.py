"""The streaming client of ``kvmesh bench serve`` against a small fake OpenAI server: timing
capture, usage vs chunk counting, and every failure kind. Also the SSE decoder it relies on.

``fake_openai_server`` runs in a thread with its own event loop so that synchronous callers (the
CLI smoke test in test_loadgen_bench_serve.py) can use it too. The request's ``model`` picks how
it behaves (see ``FakeOpenAI.handle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.sse import SseDecoder, StreamUsage, read_chunk
from kvmesh.loadgen.sse_client import CHAT, SseEndpoint, request_body, run_requests, send_request
from kvmesh.loadgen.workload import WorkloadPrompt

PROMPT = WorkloadPrompt(token_ids=(10, 11, 12), output_len=5, text="abc")


def sse(payload: dict[str, Any]) -> bytes:
    import orjson

    return b"data: " + orjson.dumps(payload) + b"\n\n"


@dataclass
class FakeOpenAI:
    """Streams ``max_tokens`` chunks of "x": the first after ``ttft_s``, then one per ``gap_s``."""

    ttft_s: float = 0.03
    gap_s: float = 0.01
    bodies: list[dict[str, Any]] = field(default_factory=list)
    url: str = ""
    model_id: str = "served-fake"  # what /v1/models lists

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = len(self.bodies)
        self.bodies.append(body)
        behaviour = body["model"]
        if behaviour == "rate-limited" or (behaviour == "flaky" and count % 3 == 2):
            error = {"message": "slow down", "type": "rate_limit"}
            return web.json_response({"error": error}, status=429)
        if behaviour == "hang":
            await asyncio.sleep(1.0)
        if behaviour == "drop":
            request.transport.close()
            return web.Response()
        is_chat = request.path == CHAT
        num_tokens = body.get("max_tokens") or body["max_completion_tokens"]
        per_chunk = 2 if behaviour == "pairs" else 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            choice = {"delta": {"content": text}} if is_chat else {"text": text}
            choices = [{"index": 0, **choice, "finish_reason": finish}]
            return {"id": f"cmpl-{count}", "choices": choices, "usage": None}

        if is_chat:
            await response.write(sse({"choices": [{"delta": {"role": "assistant"}}]}))
        await asyncio.sleep(self.ttft_s)
        num_chunks = 0 if behaviour == "empty" else math.ceil(num_tokens / per_chunk)
        for i in range(num_chunks):
            if i:
                await asyncio.sleep(self.gap_s)
            if behaviour == "stream-error" and i == 2:
                await response.write(sse({"error": {"message": "decode worker lost"}}))
                await response.write(b"data: [DONE]\n\n")
                return response
            if behaviour == "cut" and i == 2:
                request.transport.close()
                return response
            await response.write(sse(chunk("x" * per_chunk)))
        await response.write(sse(chunk("", "length")))
        if body.get("stream_options", {}).get("include_usage") and behaviour != "no-usage":
            usage = {"prompt_tokens": len(body.get("prompt", "")), "completion_tokens": num_tokens}
            await response.write(sse({"choices": [], "usage": usage}))
        if behaviour != "no-done":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@contextlib.contextmanager
def fake_openai_server(**options: Any) -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI(**options)
    app = web.Application()
    app.router.add_post("/v1/completions", fake.handle)
    app.router.add_post(CHAT, fake.handle)
    app.router.add_get(
        "/v1/models",
        lambda _: web.json_response({"object": "list", "data": [{"id": fake.model_id}]}),
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> web.AppRunner:
        runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        return runner

    async def stop(runner: web.AppRunner) -> None:
        await runner.cleanup()
        # handlers still sleeping (a "hang" the client gave up on) end here, not at loop.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    runner = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield fake
    finally:
        asyncio.run_coroutine_threadsafe(stop(runner), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def server() -> Iterator[FakeOpenAI]:
    with fake_openai_server() as fake:
        yield fake


async def send(
    url: str, model: str, prompt: WorkloadPrompt = PROMPT, **options: Any
) -> RequestRecord:
    path = options.pop("path", "/v1/completions")
    timeout_s = options.pop("timeout_s", 5.0)
    endpoint = SseEndpoint(base_url=url, model=model, path=path, **options)
    async with aiohttp.ClientSession() as session:
        return await send_request(
            session, endpoint, prompt, origin=time.perf_counter(), timeout_s=timeout_s
        )


# --- timing capture ----------------------------------------------------------------------------


async def test_completion_stream_records_first_token_and_every_chunk(server):
    r = await send(server.url, "ok")
    assert r.is_ok, r.detail
    assert len(r.chunk_times) == 5
    assert server.ttft_s * 0.9 <= r.ttft_s < server.ttft_s + 0.5
    # every chunk's time, in order; the gaps between them are what they add up to (each gap alone
    # is not bounded below: a loaded box can read two chunks the server sent 10 ms apart at once)
    assert list(r.chunk_times) == sorted(r.chunk_times)
    assert len(r.itl_s) == 4 and all(gap >= 0 for gap in r.itl_s)
    assert sum(r.itl_s) == pytest.approx(r.chunk_times[-1] - r.chunk_times[0])
    # the server slept ttft + 4 gaps before the last chunk: it cannot have come sooner
    assert r.chunk_times[-1] - r.send_s >= (server.ttft_s + 4 * server.gap_s) * 0.9
    assert r.end_s >= r.chunk_times[-1] >= r.send_s
    assert (r.num_output_tokens, r.prompt_len) == (5, 3)  # from the usage chunk
    body = server.bodies[-1]
    assert body["prompt"] == [10, 11, 12] and body["max_tokens"] == 5
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0


async def test_chat_stream_does_not_count_the_role_chunk(server):
    r = await send(server.url, "ok", path=CHAT)
    assert r.is_ok, r.detail
    assert len(r.chunk_times) == 5
    assert r.ttft_s >= server.ttft_s * 0.9  # the role chunk came at once; it is no token
    body = server.bodies[-1]
    assert body["messages"] == [{"role": "user", "content": "abc"}]
    assert body["max_completion_tokens"] == 5 and "prompt" not in body


async def test_record_keeps_the_id_the_stream_gave_the_request(server):
    r = await send(server.url, "ok")
    assert r.is_ok, r.detail
    assert r.response_id == f"cmpl-{len(server.bodies) - 1}"
    assert (await send(server.url, "rate-limited")).response_id == ""  # no stream, no id


async def test_usage_token_count_wins_over_the_number_of_chunks(server):
    r = await send(server.url, "pairs")
    assert r.is_ok and len(r.chunk_times) == 3 and r.num_output_tokens == 5


async def test_chunk_count_stands_in_when_the_server_sends_no_usage(server):
    r = await send(server.url, "no-usage", WorkloadPrompt((1, 2, 3, 4), 4))
    assert r.is_ok and r.num_output_tokens == 4 and r.prompt_len == 4


# --- failure kinds -----------------------------------------------------------------------------


async def test_http_error_status_is_its_own_kind(server):
    r = await send(server.url, "rate-limited")
    assert r.error == "http_429" and "slow down" in r.detail
    assert r.chunk_times == () and r.ttft_s is None


async def test_error_event_mid_stream_is_a_stream_error(server):
    r = await send(server.url, "stream-error")
    assert r.error == "stream_error" and r.detail == "decode worker lost"
    assert len(r.chunk_times) == 2


async def test_connection_closed_mid_stream_is_incomplete(server):
    r = await send(server.url, "cut")
    assert r.error == "incomplete" and len(r.chunk_times) == 2


async def test_stream_without_done_is_incomplete(server):
    r = await send(server.url, "no-done")
    assert r.error == "incomplete" and "[DONE]" in r.detail


async def test_stream_without_output_is_empty_output(server):
    r = await send(server.url, "empty")
    assert r.error == "empty_output"


async def test_slow_server_is_a_timeout(server):
    r = await send(server.url, "hang", timeout_s=0.2)
    assert r.error == "timeout"
    assert 0.15 < r.e2e_s < 0.9


async def test_connection_closed_before_a_response_is_a_connection_error(server):
    r = await send(server.url, "drop")
    assert r.error == "connection_error"


async def test_refused_connection_is_a_connection_error():
    from kvmesh.shared.config.ports import free_port

    r = await send(f"http://127.0.0.1:{free_port()}", "ok")
    assert r.error == "connection_error" and r.chunk_times == ()


# --- open-loop sending -------------------------------------------------------------------------


async def test_requests_go_out_at_their_arrival_times(server):
    arrivals = [0.0, 0.1, 0.25]
    prompts = [WorkloadPrompt((1, 2), 2)] * 3
    endpoint = SseEndpoint(base_url=server.url, model="ok")
    seen: list[int] = []
    records, duration_s = await run_requests(
        endpoint, prompts, arrivals, timeout_s=5.0, on_record=lambda r: seen.append(r.index)
    )
    assert [r.index for r in records] == [0, 1, 2] and sorted(seen) == [0, 1, 2]
    for r, at in zip(records, arrivals, strict=True):
        assert r.is_ok and r.arrival_s == at
        assert at - 0.002 <= r.send_s < at + 0.05
    assert duration_s >= max(r.end_s for r in records)


async def test_max_concurrency_holds_requests_back(server):
    prompts = [WorkloadPrompt((1, 2), 3)] * 3
    endpoint = SseEndpoint(base_url=server.url, model="ok")
    records, _ = await run_requests(endpoint, prompts, [0.0] * 3, timeout_s=5.0, max_concurrency=1)
    assert all(r.is_ok for r in records)
    ordered = sorted(records, key=lambda r: r.send_s)
    for before, after in itertools.pairwise(ordered):
        assert after.send_s >= before.end_s - 0.002


# --- request bodies and SSE parsing (pure) -----------------------------------------------------


def test_request_body_sends_text_or_ids_and_merges_extra_fields():
    endpoint = SseEndpoint(base_url="http://h", model="m", send_ids=False, ignore_eos=False)
    body = request_body(endpoint, PROMPT)
    assert body["prompt"] == "abc" and "ignore_eos" not in body
    with_extra = SseEndpoint(base_url="http://h", model="m", extra_body={"min_tokens": 5})
    assert request_body(with_extra, PROMPT)["min_tokens"] == 5
    no_text = WorkloadPrompt((1, 2), 3)
    assert request_body(endpoint, no_text)["prompt"] == [1, 2]
    with pytest.raises(ValueError, match="endpoint"):
        SseEndpoint(base_url="http://h", model="m", path="/v1/embeddings")


def test_sse_decoder_handles_any_split_crlf_comments_and_multiline_data():
    stream = b': keep-alive\r\ndata: {"a":\r\ndata: 1}\r\n\r\nevent: x\ndata:[DONE]\n\n'
    for cut in range(len(stream) + 1):
        decoder = SseDecoder()
        events = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert events == ['{"a":\n1}', "[DONE]"]


def test_read_chunk_reads_content_usage_done_and_errors():
    assert read_chunk('{"choices": [{"text": "hi"}]}', is_chat=False).content == "hi"
    assert read_chunk('{"choices": [{"delta": {"content": "yo"}}]}', is_chat=True).content == "yo"
    assert read_chunk('{"choices": [{"delta": {"role": "assistant"}}]}', is_chat=True).content == ""
    usage = read_chunk(
        '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}', False
    )
    assert usage.usage == StreamUsage(3, 7) and usage.content == ""
    assert read_chunk("[DONE]", False).is_done
    assert read_chunk('{"id": "cmpl-7", "choices": []}', False).response_id == "cmpl-7"
    assert read_chunk('{"id": 7, "choices": []}', False).response_id == ""
    assert read_chunk('{"error": {"message": "boom"}}', False).error == "boom"
    assert "not JSON" in (read_chunk("{oops", False).error or "")


def test_empty_text_chunks_are_tokens_but_role_and_finish_chunks_are_not():
    def is_token(data: str, chat: bool) -> bool:
        return read_chunk(data, is_chat=chat).is_token

    assert is_token('{"choices": [{"text": "", "finish_reason": null}]}', False)
    assert is_token('{"choices": [{"delta": {"content": ""}, "finish_reason": null}]}', True)
    assert is_token('{"choices": [{"text": "x", "finish_reason": "stop"}]}', False)
    assert not is_token('{"choices": [{"text": "", "finish_reason": "length"}]}', False)
    assert not is_token('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}', True)
    assert not is_token(
        '{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}', False
    )
