"""A decode worker killed mid-stream (kill -9, real processes): its streams migrate to the other
decode worker, prompt plus the tokens sent so far prefilled again, and every client gets the
offline engine's greedy tokens, without a gap or a repeat, long before any timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import aiohttp
import pytest

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts, wait_blocks_returned
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

ENV = {"KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "1024"}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def mesh():
    # decode paced at 100 ms: 40 tokens take ~4 s, so the kill lands mid-stream
    with local_mesh("disagg", "shm", env=ENV, decode=2, decode_pacing_ms=100) as launcher:
        yield launcher


def _migrations(launcher) -> float:
    text = urllib.request.urlopen(f"{launcher.url}/metrics", timeout=5).read().decode()
    prefix = 'kvmesh_router_retries_total{role="decode-migrate"} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


async def _stream_then_kill(launcher, prompts):
    async with (
        MeshTap(launcher.config.nats_url, launcher.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        tasks = [
            asyncio.create_task(complete(session, launcher.url, p, MAX_TOKENS, ignore_eos=True))
            for p in prompts
        ]
        while sum(len(t) >= 3 for t in tap.tokens.values()) < len(prompts):
            await asyncio.sleep(0.05)  # every stream is under way
        _, proc = launcher.children["decode-0"]
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        bodies = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        elapsed = time.monotonic() - killed
        streams = {rid: list(ids) for rid, ids in tap.tokens.items()}
    return bodies, streams, elapsed


def test_killed_decode_worker_streams_migrate_with_the_same_greedy_tokens(mesh):
    prompts = random_prompts(6, 100, 300, seed=31)
    expected = offline_greedy(prompts, MAX_TOKENS, ignore_eos=True)
    bodies, streams, elapsed = asyncio.run(_stream_then_kill(mesh, prompts))
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in bodies)
    migrated = 0
    for body, want in zip(bodies, expected, strict=True):
        rid = body["id"]
        tokens = streams[rid]
        if f"{rid}-m1" in streams:  # it was on decode-0: the rest came from decode-1
            tokens = tokens + streams[f"{rid}-m1"]
            migrated += 1
        assert tokens == want, rid
    assert migrated >= 1 and _migrations(mesh) == migrated
    assert elapsed < 20  # about one heartbeat timeout and a prefill, not the 30 s token timeout
    rows = asyncio.run(wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth))
    assert [r.worker_id for r in rows] == ["decode-1"]
    assert all(r.pool.free_blocks == r.pool.total_blocks for r in rows)
    assert mesh.nats_violations() == []
