"""Worker deaths under load, with real processes (kill -9): no request hangs or waits out a timeout.

A mesh of two prefill and two decode workers (kvmesh-tiny, shm). Long prompts in small chunks keep
the requests in prefill when a worker is killed. The kv-registry drops the dead worker after
about three heartbeats and announces it (WorkerGone). The router then runs every request that had
no token yet again, elsewhere, and the decode workers free the blocks a dead prefill was writing.
With no prefill worker left, long prompts are prefilled on the decode worker.
Every request must end with the offline engine's greedy tokens, long before the router's
timeouts, and every block must come back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts, wait_blocks_returned
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "2048"}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def mesh():
    with local_mesh("disagg", "shm", env=ENV, prefill=2, decode=2) as launcher:
        yield launcher


def _kill(launcher, name: str) -> None:
    _, proc = launcher.children[name]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


async def _load_then_kill(launcher, prompts, victim: str, delay_s: float):
    """Send ``prompts`` and kill ``victim`` ``delay_s`` later; a prefill worker once it has also
    taken a job (its PrefillStarted): at a fixed delay alone, a loaded box may not have handed it
    one yet, and then nothing of it is left to run again."""
    from kvmesh.shared.bus.messages.codec import decode_message
    from kvmesh.shared.bus.messages.prefill_jobs import PrefillStarted
    from kvmesh.shared.bus.nats_connect import connect_nats
    from kvmesh.shared.config.subjects import Subjects

    took_job = asyncio.Event()

    async def on_started(msg) -> None:
        if decode_message(msg.data, PrefillStarted).worker_id == victim:
            took_job.set()

    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        connect_nats(launcher.config.nats_url, "fault-test", auth=launcher.nats_auth) as nc,
        aiohttp.ClientSession() as session,
    ):
        await nc.subscribe(
            Subjects(launcher.config.mesh).request_prefill_started("*"), cb=on_started
        )
        await nc.flush()
        started = time.monotonic()
        tasks = [
            asyncio.create_task(complete(session, launcher.url, p, MAX_TOKENS)) for p in prompts
        ]
        await asyncio.sleep(delay_s)
        if victim.startswith("prefill"):
            try:
                await asyncio.wait_for(took_job.wait(), 30)
            except TimeoutError:  # say whether it was alive to take one
                exited = {spec.name: code for spec, code in launcher.dead()}
                raise AssertionError(f"{victim} took no job in 30 s; exited: {exited}") from None
        _kill(launcher, victim)
        bodies = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        elapsed = time.monotonic() - started
        # across the wire ids of each request's attempts (retries, migrations)
        tokens = [(await tap.wait_answered(body["id"]))[1] for body in bodies]
    return bodies, tokens, elapsed


def _retries(launcher, role: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"{launcher.url}/metrics", timeout=5).read().decode()
    prefix = f'kvmesh_router_retries_total{{role="{role}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_killed_decode_worker_requests_run_again_on_the_other(mesh):
    prompts = random_prompts(6, 1200, 1500, seed=21)
    bodies, tokens, elapsed = asyncio.run(_load_then_kill(mesh, prompts, "decode-0", 0.3))
    assert tokens == offline_greedy(prompts, MAX_TOKENS)
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
    assert elapsed < 30  # the router's first-token timeout is 300 s, its token timeout 30 s
    assert _retries(mesh, "decode") >= 1  # some requests were on the killed worker
    rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth))
    assert [r.worker_id for r in rows] == ["decode-1"]
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)


def test_killed_prefill_worker_jobs_run_again_on_the_other(mesh):
    prompts = random_prompts(4, 1500, 1800, seed=22)
    bodies, tokens, elapsed = asyncio.run(_load_then_kill(mesh, prompts, "prefill-0", 0.3))
    assert tokens == offline_greedy(prompts, MAX_TOKENS)
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
    assert elapsed < 30
    assert _retries(mesh, "prefill") >= 1
    rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth))
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)
    assert mesh.nats_violations() == []


def test_with_every_prefill_worker_dead_long_prompts_are_prefilled_on_decode(mesh):
    prompts = random_prompts(3, 1000, 1200, seed=23)
    # prefill-0 died in the test before; prefill-1 goes now, while these are queued or computing
    bodies, tokens, elapsed = asyncio.run(_load_then_kill(mesh, prompts, "prefill-1", 0.2))
    assert tokens == offline_greedy(prompts, MAX_TOKENS)
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
    assert elapsed < 30  # not the 300 s first-token timeout of a job nobody will take
    rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth))
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)
    assert mesh.nats_violations() == []
