"""Clients that stop reading never stall the router (real processes): 20 streams whose clients
send a request and then read nothing (small receive buffers) run beside normal streams. The router
cuts each stalled one off once its send buffer is full or a write waits longer than the write
timeout, aborts its mesh work (its blocks come back) and logs no traceback; meanwhile a normal
stream's tokens keep coming (worst gap under 1 s), /metrics answers, and the router keeps its
heartbeats (the registry never drops it)."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import aiohttp
import orjson
import pytest
from kvmesh.loadgen.bench_mesh import local_mesh, random_prompts, wait_blocks_returned

pytestmark = pytest.mark.slow

NUM_STALLED, STALLED_TOKENS = 20, 3000  # ~500 KB of SSE each
NUM_NORMAL, NORMAL_TOKENS = 4, 40
WRITE_TIMEOUT_S = 2.0
ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "4096",
    "KVMESH_CLIENT_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
    "KVMESH_CLIENT_SEND_BUFFER_KB": "16",
}


def _stalled_client(port: int, prompt: list[int]) -> socket.socket:
    """A streaming request whose client reads nothing, with a 4 KiB receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = orjson.dumps(
        {
            "model": "kvmesh-tiny",
            "prompt": prompt,
            "max_tokens": STALLED_TOKENS,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


async def _normal_stream(session, url: str, prompt: list[int]) -> tuple[float, int]:
    """One normal stream: its worst gap between token chunks and its number of tokens."""
    body = {
        "model": "kvmesh-tiny",
        "prompt": prompt,
        "max_tokens": NORMAL_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    gaps, last, num_tokens = [0.0], None, 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            event = orjson.loads(line[len(b"data: ") :])
            assert "error" not in event, event
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
            num_tokens += 1
    return max(gaps), num_tokens - 1  # less the finish chunk


def _metrics_seconds(url: str) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        resp.read()
    return time.monotonic() - started


async def _scenario(mesh) -> dict:
    url, port = mesh.url, mesh.port
    prompts = random_prompts(NUM_STALLED + NUM_NORMAL, 20, 40, seed=7)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        # a normal stream first: the decode worker is warm
        await _normal_stream(session, url, prompts[-1])
        stalled = [await asyncio.to_thread(_stalled_client, port, p) for p in prompts[:NUM_STALLED]]
        started = time.monotonic()
        metrics_s: list[float] = []

        async def poll_metrics() -> None:
            while True:
                metrics_s.append(await asyncio.to_thread(_metrics_seconds, url))
                await asyncio.sleep(0.5)

        poller = asyncio.create_task(poll_metrics())
        normal = []
        for p in prompts[NUM_STALLED:]:  # one after another, while the stalled ones are held
            normal.append(await _normal_stream(session, url, p))
        # the stalled streams are cut off within their write timeout of their buffers filling
        await asyncio.sleep(WRITE_TIMEOUT_S + 1)
        poller.cancel()
        ended = time.monotonic()
        for sock in stalled:
            sock.close()
        rows = await wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth, timeout_s=10)
        returned_s = time.monotonic() - ended
    return {
        "normal": normal,
        "metrics_s": metrics_s,
        "rows": rows,
        "returned_s": returned_s,
        "held_s": ended - started,
    }


def _router_metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_stalled_clients_are_cut_off_and_never_stall_the_router_or_normal_streams(capfd):
    with local_mesh("disagg", "shm", env=ENV, local_prefill_threshold=64) as mesh:
        result = asyncio.run(_scenario(mesh))
        workers = asyncio.run(_admin_workers(mesh))
        aborted = _router_metric(mesh.url, "kvmesh_router_client_cutoffs_total")
    gaps = [gap for gap, _ in result["normal"]]
    print(f"\nworst token gaps of the normal streams: {[round(g, 3) for g in gaps]} s")
    print(f"/metrics: worst {max(result['metrics_s']):.3f} s over {len(result['metrics_s'])} polls")
    print(f"blocks back {result['returned_s']:.2f} s after the load; cut off: {aborted:g}")
    assert [n for _, n in result["normal"]] == [NORMAL_TOKENS] * NUM_NORMAL
    assert max(gaps) < 1.0
    assert max(result["metrics_s"]) < 1.0
    assert aborted == NUM_STALLED  # every stalled stream was cut off by the router
    assert result["rows"] and all(r["free_blocks"] == r["total_blocks"] for r in result["rows"])
    assert "router-0" in workers
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Error handling request" not in err, err[-3000:]
    dropped = [line for line in err.splitlines() if "worker dropped" in line]
    assert not [line for line in dropped if "router" in line]  # its heartbeats kept coming


async def _admin_workers(mesh) -> set[str]:
    from kvmesh.shared.admin_client import admin_client

    async with admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin:
        return {w["worker_id"] for w in await admin.workers()}
