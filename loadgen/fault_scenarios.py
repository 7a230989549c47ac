"""The faults of ``fault_drill.py``, each injected into a running mesh (a ``launched`` one,
its supervisor run for the drill where it restarts what was killed) under streaming load
(``drill_streams.py``): what the clients saw, and how long after the load every decode block
was free again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from kvmesh.loadgen.drill_streams import StreamOutcome, end_of, stream_body, stream_load

# the fault tests' engine settings (small pools; no kv-store: it takes no --num-blocks with them)
ENV = {"KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "2048", "KVMESH_CHUNK_TOKENS": "64"}


async def blocks_back_s(mesh: Any, since: float, timeout_s: float = 60.0) -> float | None:
    """Seconds after ``since`` when every decode worker had all its blocks free (None: not
    within ``timeout_s``)."""
    from kvmesh.testing.mesh import wait_blocks_returned

    rows = await wait_blocks_returned(
        mesh.config.nats_url, mesh.nats_auth, timeout_s, workers=mesh.config.decode
    )
    if rows and all(r.pool.free_blocks == r.pool.total_blocks for r in rows):
        return max(0.0, time.monotonic() - since)
    return None


@contextlib.asynccontextmanager
async def supervising(mesh: Any, first_delay_s: float = 1.0) -> AsyncIterator[None]:
    """The launcher's supervisor (restarts dead services and its nats-server) runs for the
    block."""
    from kvmesh.commands.restarts import RestartPolicy

    policy = RestartPolicy(max_restarts=5, first_delay_s=first_delay_s)
    task = asyncio.create_task(mesh.supervise(policy, poll_s=0.1))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def load_under_way(
    mesh: Any, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> asyncio.Task[list[StreamOutcome | None]]:
    """The load of ``prompts``, started; returns once its first token has streamed."""
    under_way = asyncio.Event()
    load = asyncio.create_task(
        stream_load(mesh.url, prompts, max_tokens, concurrency, under_way=under_way)
    )
    await under_way.wait()
    return load


Outcomes = tuple[list[StreamOutcome | None], float | None]


async def with_blocks_back(mesh: Any, outcomes: list[StreamOutcome | None]) -> Outcomes:
    """The outcomes, and how long after the last one every decode block was free again."""
    return outcomes, await blocks_back_s(mesh, end_of(outcomes))


async def nats_outage(
    mesh: Any,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    outage_s: float,
    during: Sequence[list[int]] = (),
) -> Outcomes:
    """Streams through a kill -9 of the mesh's nats-server, restarted ``outage_s`` later; the
    ``during`` prompts are sent halfway through the outage (after ``prompts``' outcomes)."""
    async with supervising(mesh, first_delay_s=outage_s):
        load = await load_under_way(mesh, prompts, max_tokens, concurrency)
        os.kill(mesh.nats.pid, signal.SIGKILL)
        late: list[StreamOutcome | None] = []
        if during:
            await asyncio.sleep(outage_s / 2)
            late = await stream_load(mesh.url, list(during), max_tokens, len(during))
        return await with_blocks_back(mesh, await load + late)


async def registry_kill(mesh: Any, prompts: list[list[int]], max_tokens: int) -> Outcomes:
    """Requests whose placements the kv-registry holds when it is killed: it is stopped, they
    are sent to it, and it is killed; the supervisor restarts it a second later."""
    async with supervising(mesh):
        _, registry = mesh.children["kv-registry-0"]
        os.kill(registry.pid, signal.SIGSTOP)
        load = asyncio.create_task(stream_load(mesh.url, prompts, max_tokens, len(prompts)))
        await asyncio.sleep(1.0)  # each placement is with the stopped registry now
        os.kill(registry.pid, signal.SIGKILL)
        return await with_blocks_back(mesh, await load)


async def worker_kill(
    mesh: Any, prompts: list[list[int]], max_tokens: int, concurrency: int, name: str
) -> Outcomes:
    """kill -9 of the service ``name`` (decode-0, prefill-0, kv-store-0, draft-0 ...) at the
    load's first token (a decode worker: once it holds one of the load's requests, which the
    first token alone does not promise when another decode worker took the first ones); the
    supervisor restarts it a second later."""
    async with supervising(mesh):
        _, proc = mesh.children[name]
        load = await load_under_way(mesh, prompts, max_tokens, concurrency)
        if name.startswith("decode-"):
            await _until_holding(mesh.metrics_urls[name], load)
        os.kill(proc.pid, signal.SIGKILL)
        return await with_blocks_back(mesh, await load)


def _decode_requests(metrics_url: str) -> float:
    """A decode worker's requests, running or waiting (its /metrics)."""
    from kvmesh.loadgen.bench_kv_turns import scrape

    samples = scrape(metrics_url, timeout_s=5)
    names = ("kvmesh_decode_requests_running", "kvmesh_decode_requests_waiting")
    return sum(samples.get(name, 0.0) for name in names)


async def _until_holding(
    metrics_url: str, load: asyncio.Task[Any], timeout_s: float = 10.0
) -> None:
    """Until the decode worker at ``metrics_url`` holds a request, the load ended, or
    ``timeout_s`` ran out (then the drill goes on: its caller sees that nothing moved)."""
    deadline = time.monotonic() + timeout_s
    while not load.done() and time.monotonic() < deadline:
        if await asyncio.to_thread(_decode_requests, metrics_url) > 0:
            return
        await asyncio.sleep(0.02)


async def decode_stop(
    mesh: Any, prompts: list[list[int]], max_tokens: int, concurrency: int, outage_s: float
) -> Outcomes:
    """SIGSTOP of decode-0 for ``outage_s`` under load, then SIGCONT."""
    _, decode = mesh.children["decode-0"]
    load = await load_under_way(mesh, prompts, max_tokens, concurrency)
    os.kill(decode.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(outage_s)
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    resumed = time.monotonic()
    outcomes = await load
    # a stopped worker frees nothing: from the end of the load or the SIGCONT, the later
    return outcomes, await blocks_back_s(mesh, max(end_of(outcomes), resumed))


def _stalled_client(port: int, prompt: list[int], max_tokens: int) -> socket.socket:
    """A streaming request whose client reads nothing, with a 4 KiB receive buffer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = orjson.dumps(stream_body(prompt, max_tokens))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


async def stalled_clients(
    mesh: Any,
    stalled: list[list[int]],
    stalled_tokens: int,
    normal: list[list[int]],
    normal_tokens: int,
    hold_s: float,
) -> dict[str, Any]:
    """Clients that send a streaming request and read nothing for ``hold_s`` (then close),
    beside normal streams sent one after another meanwhile; /metrics is polled throughout."""
    import urllib.request

    def metrics_s() -> float:
        started = time.monotonic()
        with urllib.request.urlopen(f"{mesh.url}/metrics", timeout=10) as resp:
            resp.read()
        return time.monotonic() - started

    socks = [
        await asyncio.to_thread(_stalled_client, mesh.port, p, stalled_tokens) for p in stalled
    ]
    started = time.monotonic()
    polls: list[float] = []

    async def poll() -> None:
        while True:
            polls.append(await asyncio.to_thread(metrics_s))
            await asyncio.sleep(0.5)

    poller = asyncio.create_task(poll())
    outcomes: list[StreamOutcome | None] = []
    while time.monotonic() - started < hold_s or not outcomes:
        prompt = normal[len(outcomes) % len(normal)]
        outcomes += await stream_load(mesh.url, [prompt], normal_tokens, 1)
    left = hold_s - (time.monotonic() - started)
    if left > 0:
        await asyncio.sleep(left)
    poller.cancel()
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"{mesh.url}/metrics", timeout=10).read().decode()
    )
    for sock in socks:
        sock.close()
    ended = time.monotonic()
    return {
        "normal": outcomes,
        "cutoffs": sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kvmesh_router_client_cutoffs_total{")
        ),
        "metrics_s": polls,
        "blocks_back_s": await blocks_back_s(mesh, ended),
    }
