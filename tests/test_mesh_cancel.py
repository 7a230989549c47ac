"""End to end: a client that goes away gets every KV block back, mid-stream and mid-prefill.

Real processes (nats-server, kv-registry, router, prefill, decode; kvmesh-tiny), every prompt
prefilled remotely in 32-token chunks. Disconnecting makes the router publish Abort: the decode
worker aborts a running sequence; a prefill stops between chunks and sends PrefillDone(ok=False)
once no write is in flight, and only then does the decode worker free the reserved blocks.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
import pytest
from kvmesh.loadgen.bench_mesh import (
    MODEL,
    MeshTap,
    complete,
    local_mesh,
    random_prompts,
    wait_blocks_returned,
)
from kvmesh.shared import protocol
from kvmesh.shared.nats_service import connect_nats
from kvmesh.shared.subjects import DEFAULT_MESH, Subjects

pytestmark = pytest.mark.slow

ENV = {"KVMESH_CHUNK_TOKENS": "32", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "1024"}


@pytest.fixture(scope="module")
def mesh():
    with local_mesh("disagg", env=ENV, local_prefill_threshold=0) as mesh:
        yield mesh


async def _stream_until(session, url: str, prompt: list[int], enough) -> str:
    """Stream a long generation; close the connection once ``enough(request_id)`` holds."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 2000,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                request_id = orjson.loads(line[6:])["id"]
                if enough(request_id):
                    return request_id  # leaving the block closes the connection
    raise AssertionError("the stream ended before the client disconnected")


async def _assert_all_blocks_free(mesh) -> None:
    rows = await wait_blocks_returned(mesh.config.nats_url, mesh.nats_auth)
    assert rows and all(r["free_blocks"] == r["total_blocks"] for r in rows), rows
    # The test's own job subscription (as admin) is allowed; no role overstepped.
    assert mesh.nats_violations() == []


async def test_cancel_mid_stream_aborts_decode_and_returns_blocks(mesh):
    [prompt] = random_prompts(1, 100, 100, seed=3)
    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        rid = await _stream_until(session, mesh.url, prompt, lambda r: len(tap.tokens[r]) >= 5)
        final = await tap.wait_finished(rid, timeout_s=20)
        assert final.finish_reason == "abort"
        assert 5 <= len(tap.tokens[rid]) < 2000
    await _assert_all_blocks_free(mesh)


async def test_disconnect_mid_prefill_stops_prefill_and_returns_blocks(mesh):
    [prompt] = random_prompts(1, 4000, 4000, seed=4)  # 125 chunks of 32 tokens
    job_seen = asyncio.Event()
    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        connect_nats(mesh.config.nats_url, "test-jobs", auth=mesh.nats_auth) as nc,
        aiohttp.ClientSession() as session,
    ):
        jobs: list[protocol.PrefillJob] = []

        async def on_job(msg) -> None:
            jobs.append(protocol.decode_message(msg.data, protocol.PrefillJob))
            job_seen.set()

        jobs_subject = Subjects(DEFAULT_MESH).PREFILL_JOBS
        await nc.subscribe(jobs_subject, cb=on_job)  # a copy, outside the queue group
        await nc.flush()
        client = asyncio.create_task(complete(session, mesh.url, prompt, 4))
        await asyncio.wait_for(job_seen.wait(), 30)
        rid = jobs[0].request_id
        await asyncio.sleep(0.3)  # a few chunks computed and written, most still to come
        assert rid not in tap.prefill_done, "the prefill finished before the client left"
        client.cancel()  # the client disconnects
        with contextlib.suppress(asyncio.CancelledError):
            await client
        for _ in range(300):
            if rid in tap.prefill_done:
                break
            await asyncio.sleep(0.05)
        done = tap.prefill_done[rid]
        assert not done.ok and "abort" in done.error, done
        num_chunks = -(-len(prompt) // 32)
        assert 1 <= done.num_writes < num_chunks  # it stopped between chunks
        assert rid not in tap.reports or tap.reports[rid].num_chunks < num_chunks
    await _assert_all_blocks_free(mesh)
    # the prefill and decode workers are fine afterwards
    async with aiohttp.ClientSession() as session:
        reply = await complete(session, mesh.url, random_prompts(1, 80, 80, seed=5)[0], 4)
        assert reply["usage"]["completion_tokens"] == 4
