"""Deaths of a mesh's only decode worker and of its router, with real processes (issue 43 #2, #4).

One mesh (kvmesh-tiny, shm, 1 prefill + 1 decode, heartbeats every 0.5 s, decode paced at
80 ms so streams are in flight when the faults land):

- kill -9 of the only decode worker after its streams' first tokens; the test starts its
  replacement (as `kvmesh up`'s supervisor does) only once the registry has announced it gone,
  so the migrations find no decode worker alive for certain. The replacement heartbeats
  ``starting`` as soon as it reaches NATS, and every request ends with the offline engine's
  greedy tokens, instead of "no decode worker is alive" (a 503) at once;
- kill -9 of the router with streams decoding and reservations waiting for prefill jobs (the
  prefill worker stopped, its heartbeats sent for it, so its jobs wait in the queue): once the
  registry announces the router gone, the decode worker aborts its sequences and frees every
  block, long before any lease (30 s) runs out, and the prefill worker, let go, refuses the
  router's queued jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.workers import WorkerGone, WorkerHeartbeat

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts, wait_blocks_returned
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5
ENV = {
    "KVMESH_HEARTBEAT_S": str(HEARTBEAT_S),
    "KVMESH_WORKER_LIVENESS_S": "1.5",
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "1024",
}
LOCAL_BELOW = 64  # prompts shorter than this are prefilled on the decode worker


@pytest.fixture(scope="module")
def mesh():
    with local_mesh(
        "disagg",
        "shm",
        env=ENV,
        prefill=1,
        decode=1,
        decode_pacing_ms=80,
        local_prefill_threshold=LOCAL_BELOW,
    ) as launcher:
        yield launcher


@contextlib.asynccontextmanager
async def _listening(launcher, role: str = "admin") -> AsyncIterator[tuple]:
    """A connection as ``role`` (the mesh's user of it) and the WorkerGones it hears."""
    from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
    from kvmesh.shared.config.subjects import Subjects

    auth = launcher.nats_auth if role == "admin" else launcher.credentials.auth(role)
    gone: list[WorkerGone] = []
    async with connect_nats(launcher.config.nats_url, f"test-{role}", auth=auth) as nc:
        subjects = Subjects(launcher.config.mesh)

        async def on_gone(msg) -> None:
            gone.append(decode_message(msg.data, WorkerGone))

        await nc.subscribe(subjects.REGISTRY_WORKER_GONE, cb=on_gone)
        await flush_to_server(nc)
        yield nc, subjects, gone


async def _until(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        await asyncio.sleep(0.05)


async def _restart_the_only_decode_worker(launcher, prompts, max_tokens):

    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        _listening(launcher) as (nc, subjects, gone),
        aiohttp.ClientSession() as session,
    ):
        states: list[str] = []

        async def on_beat(msg) -> None:
            states.append(decode_message(msg.data, WorkerHeartbeat).load.state)

        await nc.subscribe(subjects.heartbeat("decode", "decode-0"), cb=on_beat)
        tasks = [
            asyncio.create_task(complete(session, launcher.url, p, max_tokens, ignore_eos=True))
            for p in prompts
        ]
        await _until(
            lambda: sum(len(t) >= 3 for t in tap.tokens.values()) == len(prompts), what="streams"
        )
        spec, proc = launcher.children["decode-0"]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        await _until(lambda: any(g.worker_id == "decode-0" for g in gone), what="decode-0 gone")
        # the streams' migrations find no decode worker now (before: a 503 at once)
        await asyncio.sleep(2 * HEARTBEAT_S)
        states.clear()
        launcher._spawn(spec)  # the replacement, under the same id, as kvmesh up's supervisor
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        answers = [
            r if isinstance(r, BaseException) else (await tap.wait_answered(r["id"]))[1]
            for r in results
        ]
    return answers, states


def test_streams_wait_for_a_restarting_decode_worker_and_finish_as_undisturbed(mesh):
    prompts = random_prompts(2, 20, 40, seed=41) + random_prompts(2, 100, 200, seed=42)
    max_tokens = 16
    answers, states = asyncio.run(_restart_the_only_decode_worker(mesh, prompts, max_tokens))
    assert answers == offline_greedy(prompts, max_tokens, ignore_eos=True)
    assert states[0] == "starting" and "ready" in states  # coming, then serving
    rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth))
    assert [r.worker_id for r in rows] == ["decode-0"]
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)


def _decode_requests(launcher) -> float:
    from kvmesh.loadgen.bench_kv_turns import scrape

    samples = scrape(launcher.metrics_urls["decode-0"], timeout_s=5)
    names = ("kvmesh_decode_requests_running", "kvmesh_decode_requests_waiting")
    return sum(samples.get(name, 0.0) for name in names)


async def _kill_the_router(launcher, short, long):

    _, prefill = launcher.children["prefill-0"]
    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        _listening(launcher) as (nc, subjects, gone),
        _listening(launcher, "prefill") as (as_prefill, _, _),
        aiohttp.ClientSession() as session,
    ):
        beats: list[WorkerHeartbeat] = []
        subject = subjects.heartbeat("prefill", "prefill-0")

        async def on_beat(msg) -> None:
            beats.append(decode_message(msg.data, WorkerHeartbeat))

        await nc.subscribe(subject, cb=on_beat)
        await _until(lambda: beats, what="a prefill heartbeat")
        os.kill(prefill.pid, signal.SIGSTOP)  # it takes no job; its heartbeats go on, sent here

        async def stand_in() -> None:
            beat = beats[-1]
            while True:
                sent = msgspec.structs.replace(beat, sent_at=time.time())
                await as_prefill.publish(subject, encode_message(sent))
                await asyncio.sleep(HEARTBEAT_S)

        standing_in = asyncio.create_task(stand_in())
        try:
            tasks = [
                asyncio.create_task(complete(session, launcher.url, p, 1000, ignore_eos=True))
                for p in short + long
            ]
            await _until(
                lambda: sum(len(t) >= 2 for t in tap.tokens.values()) == len(short),
                what="short streams",
            )
            await _until(  # decoding, and the long ones' reservations held for their prefill
                lambda: _decode_requests(launcher) == len(short) + len(long), what="reservations"
            )
            _, router = launcher.children["router-0"]
            os.kill(router.pid, signal.SIGKILL)
            router.wait()
            for task in tasks:  # the client sees its connection cut: nothing is left to write
                with contextlib.suppress(Exception):
                    await task
            await _until(lambda: any(g.role == "router" for g in gone), what="router gone")
            heard_gone = time.monotonic()
            rows = await wait_blocks_returned(launcher.config.nats_url, launcher.nats_auth, 10.0)
            back_s = time.monotonic() - heard_gone
            running = _decode_requests(launcher)
            num_tokens = {rid: len(t) for rid, t in tap.tokens.items()}
            await asyncio.sleep(4 * HEARTBEAT_S)
            still_decoding = {rid for rid, t in tap.tokens.items() if len(t) != num_tokens.get(rid)}
        finally:
            standing_in.cancel()
            os.kill(prefill.pid, signal.SIGCONT)
        # the prefill worker takes the router's queued jobs now, and refuses them
        await _until(lambda: len(tap.prefill_done) >= len(long), what="the queued jobs")
        dones = list(tap.prefill_done.values())
        finals = dict(tap.finished)
    return rows, back_s, running, still_decoding, dones, finals


def test_a_dead_routers_sequences_stop_and_free_their_blocks_when_it_is_announced_gone(mesh):
    short = random_prompts(3, 10, 30, seed=43)
    long = random_prompts(2, 200, 300, seed=44)
    rows, back_s, running, still_decoding, dones, finals = asyncio.run(
        _kill_the_router(mesh, short, long)
    )
    print(f"\nevery block back {back_s:.2f} s after the router was announced gone")
    assert rows and all(r.pool.free_blocks == r.pool.total_blocks for r in rows), rows
    assert running == 0 and still_decoding == set()
    aborted = [e for e in finals.values() if e.finish_reason == "abort"]
    assert len(aborted) == len(short)  # cut short: 1,000 tokens were asked for
    assert len(dones) == len(long) and all(not d.ok and "router is gone" in d.error for d in dones)
