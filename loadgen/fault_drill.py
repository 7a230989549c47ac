"""``python -m kvmesh.loadgen.fault_drill SCENARIO``: a fault injected into a real local mesh
under streaming load, and what the clients saw.

Scenarios (docs/faults.md; each on a mesh ``kvmesh up``'s Launcher starts, its supervisor running):

- ``nats-outage``: kill -9 of the nats-server the launcher started, while streams are in flight;
  the supervisor starts it again on its port after ``--outage-s``;
- ``registry-kill``: requests whose placement the kv-registry holds (it is stopped, asked, then
  killed); the supervisor restarts it and the router asks the new one;
- ``worker-kill``: kill -9 of one service (``--worker``: decode-0, prefill-0, kv-store-0,
  draft-0 ...) at the load's first token; the supervisor restarts it;
- ``decode-stop``: SIGSTOP of a decode worker for ``--outage-s`` under load, then SIGCONT (its
  blocks are counted from the SIGCONT if the load ended first);
- ``stalled-clients``: clients that stop reading (small receive buffers) beside normal streams.

Each prints how many requests ended with the offline engine's greedy text, how many with a clear
error (an HTTP error status, an SSE error event), how many hung; how long after the end of the
load every decode block was free again; and, with stalled clients, the normal streams' worst
token gap. Also the harness the fault tests share (tests/test_mesh_fault_drills.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvmesh.loadgen.module_main import run_module

MODEL = "kvmesh-tiny"
# the fault tests' engine settings (small pools; no kv-store: it takes no --num-blocks with them)
ENV = {"KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "2048", "KVMESH_CHUNK_TOKENS": "64"}


@dataclass(slots=True)
class StreamOutcome:
    """What one streaming client saw."""

    text: str = ""
    error: str | None = None  # "503: ..." (a status) or "stream: ..." (an SSE error event)
    ended_at: float = 0.0
    worst_gap_s: float = 0.0  # between two token chunks
    num_chunks: int = 0  # token chunks (not the finish chunk)


def stream_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion of ``prompt``, EOS ignored: every drill's request."""
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


async def stream_completion(
    session: Any, url: str, prompt: list[int], max_tokens: int, under_way: asyncio.Event | None
) -> StreamOutcome:
    """One greedy streamed completion; sets ``under_way`` at its first token."""
    import aiohttp

    body = stream_body(prompt, max_tokens)
    out = StreamOutcome()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                error = (await resp.json())["error"]
                out.error = f"{resp.status}: {error['message']}"
                return out
            last, done = None, False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: ") :].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = orjson.loads(payload)
                if "error" in event:
                    out.error = f"stream: {event['error']['message']}"
                    continue
                choice = event["choices"][0]
                out.text += choice["text"]
                if choice["finish_reason"] is not None:
                    continue
                out.num_chunks += 1
                now = time.monotonic()
                if last is not None:
                    out.worst_gap_s = max(out.worst_gap_s, now - last)
                last = now
                if under_way is not None:
                    under_way.set()
            if not done and out.error is None:
                out.error = "stream: ended without [DONE]"
    except TimeoutError:
        raise  # hung: the caller counts it
    except (aiohttp.ClientError, OSError) as exc:  # the connection broke
        out.error = f"connection: {exc!r}"
    finally:
        out.ended_at = time.monotonic()
    return out


async def stream_load(
    url: str,
    prompts: list[list[int]],
    max_tokens: int,
    concurrency: int,
    under_way: asyncio.Event | None = None,
    hang_s: float = 120.0,
) -> list[StreamOutcome | None]:
    """Every prompt streamed, ``concurrency`` at a time; None for a stream still open after
    ``hang_s`` (hung)."""
    import aiohttp

    queue = list(range(len(prompts)))
    outcomes: list[StreamOutcome | None] = [None] * len(prompts)

    async def client(session: Any) -> None:
        while queue:
            i = queue.pop(0)
            with contextlib.suppress(TimeoutError):  # still open after hang_s: hung (None)
                outcomes[i] = await stream_completion(
                    session, url, prompts[i], max_tokens, under_way
                )

    timeout = aiohttp.ClientTimeout(total=hang_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(concurrency)]
        _, pending = await asyncio.wait(clients, timeout=hang_s * 2)
        for task in pending:
            task.cancel()
    return outcomes


@dataclass(slots=True)
class Tally:
    right: int = 0
    wrong: list[int] = field(default_factory=list)  # a 200 with other text: never acceptable
    errors: list[str] = field(default_factory=list)
    hung: int = 0

    @property
    def total(self) -> int:
        return self.right + len(self.wrong) + len(self.errors) + self.hung

    @property
    def right_share(self) -> float:
        return self.right / self.total if self.total else 0.0

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for error in self.errors:
            kinds[error[:90]] = kinds.get(error[:90], 0) + 1
        shown = "; ".join(f"{n}x {e}" for e, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        return (
            f"{self.right}/{self.total} right ({self.right_share:.1%}), {len(self.wrong)} wrong, "
            f"{len(self.errors)} clear errors, {self.hung} hung" + (f" [{shown}]" if shown else "")
        )


def tally(outcomes: list[StreamOutcome | None], expected: list[str]) -> Tally:
    result = Tally()
    for i, (out, text) in enumerate(zip(outcomes, expected, strict=True)):
        if out is None:
            result.hung += 1
        elif out.error is not None:
            result.errors.append(out.error)
        elif out.text == text:
            result.right += 1
        else:
            result.wrong.append(i)
    return result


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
    return outcomes, await blocks_back_s(mesh, _end_of(outcomes))


# ---- the scenarios ---------------------------------------------------------------------------


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
    return outcomes, await blocks_back_s(mesh, max(_end_of(outcomes), resumed))


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


def _end_of(outcomes: list[StreamOutcome | None]) -> float:
    ends = [o.ended_at for o in outcomes if o is not None]
    return max(ends) if ends else time.monotonic()


# ---- the command -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from kvmesh.testing.mesh import launched, mesh_config, random_prompts
    from kvmesh.testing.offline import offline_texts

    config = mesh_config(
        model=MODEL,
        prefill=args.prefill,
        decode=args.decode,
        transport="shm",
        decode_pacing_ms=args.decode_pacing_ms,
        draft=None if args.draft == "none" else args.draft,
        kv_store=args.kv_store,
        startup_timeout_s=300.0,
    )
    # half short prompts (prefilled on the decode worker), half long ones (the prefill queue)
    prompts = random_prompts(args.requests // 2, 16, 48, seed=args.seed)
    prompts += random_prompts(args.requests - len(prompts), 200, 400, seed=args.seed + 1)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    with launched(config) as mesh:  # kvmesh up's defaults (the tests' ENV has no kv-store)
        if args.scenario == "stalled-clients":
            stalled, normal = prompts[: args.stalled], prompts[-4:]
            result = asyncio.run(stalled_clients(mesh, stalled, 3000, normal, 64, args.outage_s))
            gaps = [o.worst_gap_s for o in result["normal"] if o is not None]
            errors = [o.error for o in result["normal"] if o is None or o.error]
            print(
                f"stalled-clients: {len(stalled)} stalled for {args.outage_s:g} s; "
                f"{len(gaps)} normal streams, worst token gap {max(gaps):.3f} s (median of "
                f"worst {statistics.median(gaps):.3f} s), {len(errors)} failed; /metrics worst "
                f"{max(result['metrics_s']):.3f} s; {result['cutoffs']:g} cut off by the router "
                f"before they closed; blocks back {result['blocks_back_s']} s after they closed"
            )
            return 0
        expected = offline_texts(prompts, args.max_tokens, model=MODEL)
        if args.scenario == "nats-outage":
            outcomes, back = asyncio.run(
                nats_outage(
                    mesh,
                    prompts[: len(prompts) - args.during],
                    args.max_tokens,
                    args.concurrency,
                    args.outage_s,
                    during=prompts[len(prompts) - args.during :],
                )
            )
        elif args.scenario == "registry-kill":
            outcomes, back = asyncio.run(registry_kill(mesh, prompts, args.max_tokens))
        elif args.scenario == "worker-kill":
            outcomes, back = asyncio.run(
                worker_kill(mesh, prompts, args.max_tokens, args.concurrency, args.worker)
            )
        else:
            outcomes, back = asyncio.run(
                decode_stop(mesh, prompts, args.max_tokens, args.concurrency, args.outage_s)
            )
    counts = tally(outcomes, expected)
    what = args.worker if args.scenario == "worker-kill" else f"{args.outage_s:g} s"
    print(f"{args.scenario} ({what}): {counts.summary()}; blocks back {back} s")
    return 0 if counts.right_share >= 0.95 and not counts.wrong and not counts.hung else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scenario",
        choices=("nats-outage", "registry-kill", "worker-kill", "decode-stop", "stalled-clients"),
    )
    p.add_argument("--worker", default="decode-0", help="worker-kill: the service killed")
    p.add_argument(
        "--during",
        type=int,
        default=0,
        help="nats-outage: of --requests, this many are sent halfway through the outage",
    )
    p.add_argument("--outage-s", type=float, default=10.0, help="outage, stop or stall length")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--stalled", type=int, default=20, help="stalled-clients: clients that stall")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--decode-pacing-ms", type=float, default=0.0, help="kvmesh up's (0)")
    p.add_argument("--draft", choices=("ngram", "none"), default="ngram")
    p.add_argument("--kv-store", type=int, default=1)
    p.add_argument("--seed", type=int, default=33)


if __name__ == "__main__":
    run_module("fault_drill", __doc__, add_arguments, run)
