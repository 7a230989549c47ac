"""A stopping router ends what it serves cleanly: the ``Shutdown`` core on plain tasks, then a
real ``kvmesh serve router`` process on a real nats-server with the fake mesh peer
(tests/support/router_fake_mesh.py) producing slow tokens, stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import aiohttp
import orjson
import pytest
from kvmesh.services.router.shutdown import RouterStoppingError, Shutdown
from kvmesh.shared.config.ports import free_port
from support.router_fake_mesh import REPLY_TEXT, FakeMesh

REPO = Path(__file__).resolve().parents[2]
MODEL = "kvmesh-tiny"

# --- the core -----------------------------------------------------------------------------------


async def _guarded(shutdown: Shutdown, work_s: float) -> str:
    try:
        async with shutdown.guard():
            await asyncio.sleep(work_s)
    except RouterStoppingError:
        return "interrupted"
    return "finished"


async def test_stop_waits_for_requests_that_finish_within_the_grace():
    shutdown = Shutdown()
    task = asyncio.create_task(_guarded(shutdown, 0.1))
    await asyncio.sleep(0)
    assert shutdown.num_running == 1
    assert await shutdown.stop(grace_s=5.0) == 0
    assert await task == "finished"


async def test_stop_interrupts_what_outlives_the_grace_as_router_stopping():
    shutdown = Shutdown()
    slow = asyncio.create_task(_guarded(shutdown, 30.0))
    await asyncio.sleep(0)
    started = time.monotonic()
    assert await shutdown.stop(grace_s=0.2) == 1
    assert await slow == "interrupted"
    assert time.monotonic() - started < 2.0
    assert shutdown.num_running == 0
    with pytest.raises(RouterStoppingError, match="shutting down"):
        shutdown.check_open()  # and new requests are refused


async def test_a_cancellation_not_from_the_stop_stays_a_cancellation():
    shutdown = Shutdown()
    task = asyncio.create_task(_guarded(shutdown, 30.0))
    await asyncio.sleep(0)
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert shutdown.num_running == 0 and not shutdown.is_stopping


# --- a real router process ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def router_process(nats_url: str, grace_s: float, tmp_path: Path):
    port = free_port()
    argv = [sys.executable, "-m", "kvmesh.cli", "serve", "router", "--nats-url", nats_url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--shutdown-grace-s", str(grace_s)]
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = await asyncio.create_subprocess_exec(*argv, cwd=REPO, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(url) as http:
            deadline = time.monotonic() + 60
            while True:  # ready: NATS connected and the fake decode worker heard
                with contextlib.suppress(aiohttp.ClientError):
                    if (await http.get("/health")).status == 200:
                        break
                assert proc.returncode is None, log.read_text()[-2000:]
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                await asyncio.sleep(0.2)
            yield proc, http, log
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n"), raw[-80:]
    return [event.split(b"data: ", 1)[1] for event in raw[:-2].split(b"\n\n")]  # after its id


async def test_sigterm_ends_streams_with_an_error_event_and_done_and_aborts_them(
    nats_server, tmp_path
):
    grace_s = 1.5
    # ~10 tokens/s, repeating its reply: nothing ends by itself within the grace but the short one
    mesh = FakeMesh(nats_server, token_delay_s=0.1, eos_at_end=False)
    async with mesh.running(), router_process(nats_server, grace_s, tmp_path) as (proc, http, log):
        long_body = {"model": MODEL, "prompt": "hi", "max_tokens": 500}
        stream = await http.post("/v1/completions", json={**long_body, "stream": True})
        chat = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 500,
                "stream": True,
            },
        )
        plain = asyncio.create_task(http.post("/v1/completions", json=long_body))
        assert stream.status == chat.status == 200
        first = await stream.content.readuntil(b"\n\n")  # tokens are flowing
        assert orjson.loads(first.split(b"data: ", 1)[1])["choices"][0]["text"] == "T"
        short = asyncio.create_task(
            http.post("/v1/completions", json={**long_body, "max_tokens": 4, "stream": True})
        )
        await asyncio.sleep(0.2)

        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        await asyncio.sleep(0.3)
        refused = await http.post("/v1/completions", json=long_body)  # during the grace
        health = await http.get("/health")
        short_raw = await (await short).read()  # finishes within the grace: untouched
        rest = await asyncio.wait_for(stream.content.read(), grace_s + 15)
        chat_rest = await asyncio.wait_for(chat.content.read(), grace_s + 15)
        plain_resp = await asyncio.wait_for(plain, grace_s + 15)
        plain_body = await plain_resp.json()
        code = await asyncio.wait_for(proc.wait(), grace_s + 18)
        exited_after = time.monotonic() - signalled

    assert refused.status == 503 and (await refused.json())["error"]["code"] == "router_stopping"
    assert health.status == 503
    short_events = _events(short_raw)
    assert short_events[-1] == b"[DONE]"
    short_chunks = [orjson.loads(e) for e in short_events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in short_chunks) == REPLY_TEXT[:4]
    assert short_chunks[-1]["choices"][0]["finish_reason"] == "length"

    for raw in (first + rest, chat_rest):
        events = _events(raw)
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == "router_stopping" and "shutting down" in error["message"]
        assert all(b'"error"' not in e for e in events[:-2])  # one error event, at the end
    assert len(_events(first + rest)) > 1 + 5  # it streamed for the grace before it ended
    assert plain_resp.status == 503 and plain_body["error"]["code"] == "router_stopping"

    stopped = {a.request_id for a in mesh.aborts if a.reason == "router stopping"}
    assert len(stopped) == 3, mesh.aborts  # both streams and the plain request
    assert all(not a.request_id.startswith(short_chunks[0]["id"]) for a in mesh.aborts)
    assert code == 0, log.read_text()[-2000:]
    assert grace_s <= exited_after < grace_s + 6, exited_after


async def test_sigterm_with_nothing_in_flight_exits_at_once(nats_server, tmp_path):
    mesh = FakeMesh(nats_server)
    async with mesh.running(), router_process(nats_server, 30.0, tmp_path) as (proc, _, log):
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = await asyncio.wait_for(proc.wait(), 15)
    assert code == 0, log.read_text()[-2000:]
    assert time.monotonic() - signalled < 10  # the 30 s grace is for requests, not for idling
