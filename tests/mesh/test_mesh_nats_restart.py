"""The NATS server dies (kill -9) and restarts on the same port under a running mesh (real
processes) while streams are in flight: each of them ends with the offline engine's greedy text
or with a clear error (an SSE error event and [DONE], or an HTTP error status) within a bounded
time, none hangs; every service reconnects, the prefill queue is made again in the new server,
the mesh serves again within seconds, and every block comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import orjson
import pytest
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.config.ports import free_port

from kvmesh.testing.mesh import (
    complete,
    completion_body,
    local_mesh,
    random_prompts,
    wait_blocks_returned,
)
from kvmesh.testing.offline import offline_texts

pytestmark = pytest.mark.slow

# Blocks of a request the restart failed come back once its lease (router --lease-ms) and the
# decode worker's quarantine (--quarantine-s) have run out: 10 + 5 s here instead of 30 + 30 s
# by default. The lease still outlives the outage by far (the router renews it every third).
LEASE_S, QUARANTINE_S = 10, 5
ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "512",
    "KVMESH_LEASE_MS": str(LEASE_S * 1000),
    "KVMESH_QUARANTINE_S": str(QUARANTINE_S),
}
NUM_STREAMS, CONCURRENCY, MAX_TOKENS = 8, 4, 24
# the longest a stream in flight may take to end once NATS is back (never a 30 s token timeout)
END_WITHIN_S = 20.0


async def _serve_until_ok(url: str, prompt: list[int], timeout_s: float) -> tuple[dict, float]:
    """Send the request until the mesh answers it (503/504 while it reconnects)."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                return await complete(session, url, prompt, 4), time.monotonic() - started
            except (AssertionError, aiohttp.ClientError):
                assert time.monotonic() - started < timeout_s, "the mesh did not serve again"
                await asyncio.sleep(0.5)


async def _stream(session, url: str, prompt: list[int], first_token: asyncio.Event) -> dict:
    """One streamed completion: its text, or the error it ended with (an HTTP status or an SSE
    error event), and when it ended."""
    body = completion_body(prompt, MAX_TOKENS, ignore_eos=True, stream=True)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            error = (await resp.json())["error"]
            return {"error": f"{resp.status}: {error['message']}", "ended": time.monotonic()}
        text, error, done = "", None, False
        async for line in resp.content:
            if not line.strip() or line.startswith(b"id: "):  # a resumable stream's event ids
                continue
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: ") :].strip()
            assert not done, "an event after [DONE]"
            if payload == b"[DONE]":
                done = True
                continue
            event = orjson.loads(payload)
            assert error is None, "an event after the error event"
            if "error" in event:
                error = f"stream: {event['error']['message']}"
                continue
            text += event["choices"][0]["text"]
            first_token.set()
        assert done, "the stream ended without [DONE]"
    return {"text": text, "error": error, "ended": time.monotonic()}


async def _load_through_a_restart(url: str, server: NatsServer, prompts: list[list[int]]):
    """Streams at CONCURRENCY while nats-server is killed and started again on its port."""
    queue = list(range(len(prompts)))
    results: list[dict | None] = [None] * len(prompts)
    under_way = asyncio.Event()

    async def client(session) -> None:
        while queue:
            i = queue.pop(0)
            results[i] = await _stream(session, url, prompts[i], under_way)

    async def restart() -> float:
        await under_way.wait()
        # at the first token: one stream under way, the others queued or in prefill (one job
        # at a time), their jobs in the JetStream store the restart empties
        os.kill(server.pid, signal.SIGKILL)
        await asyncio.to_thread(server.stop)  # reaps it, removes its store
        await asyncio.sleep(1.0)
        await asyncio.to_thread(server.start)
        return time.monotonic()

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(CONCURRENCY)]
        back_at = await restart()
        await asyncio.wait_for(asyncio.gather(*clients), 120)  # none hangs
    return results, back_at


def test_streams_in_flight_survive_or_fail_clearly_and_the_mesh_serves_after_nats_restarts():
    prompts = random_prompts(NUM_STREAMS, 40, 300, seed=43)  # remote prefill: the queue
    expected = offline_texts(prompts, MAX_TOKENS, num_blocks=1024)
    port = free_port()
    server = NatsServer(port)
    server.start()
    try:
        # decode paced at 50 ms: a stream takes ~1.2 s, so the kill lands on streams in flight
        with local_mesh(
            "disagg", "tcp", nats_url=server.url, env=ENV, decode_pacing_ms=50, nats_insecure=True
        ) as mesh:
            body, _ = asyncio.run(_serve_until_ok(mesh.url, prompts[0], 30))
            assert body["usage"]["completion_tokens"] == 4
            results, back_at = asyncio.run(_load_through_a_restart(mesh.url, server, prompts))

            outcomes = []
            for i, result in enumerate(results):
                assert result is not None, i
                if result["error"] is None:
                    assert result["text"] == expected[i], i
                    outcomes.append("ok")
                else:
                    assert result["error"].split(":")[0] in ("stream", "502", "503", "504")
                    outcomes.append(result["error"])
                assert result["ended"] - back_at < END_WITHIN_S, (i, result)
            print(f"\nstreams through the NATS restart: {outcomes}")

            body, waited = asyncio.run(_serve_until_ok(mesh.url, prompts[1], 60))
            assert body["usage"]["completion_tokens"] == 4
            assert waited < 30
            for prompt in random_prompts(3, 200, 400, seed=42):  # and keeps serving
                body, _ = asyncio.run(_serve_until_ok(mesh.url, prompt, 5))
                assert body["usage"]["completion_tokens"] == 4
            # blocks of requests that failed come back once their leases and quarantines run out
            wait_s = LEASE_S + QUARANTINE_S + 30
            rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth, wait_s))
            assert rows and all(r.pool.free_blocks == r.pool.total_blocks for r in rows), rows
    finally:
        server.stop()
