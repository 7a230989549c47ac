"""End to end: real nats-server, kv-registry, router, prefill and decode processes (kvmesh-tiny).

32 concurrent greedy requests through the router's HTTP API; the tokens each request got (read
off its NATS token subject, keyed by the response id) must equal the offline engine's
(LLMEngine.generate) token for token, disaggregated over shm and over tcp, and colocated. Prompts
span several prefill chunks (chunk budget 32 tokens, blocks of 16). After the load every decode
worker has all its blocks free again.

A client that goes away gets every KV block back, mid-stream and mid-prefill (on the shm mesh):
disconnecting makes the router publish Abort; the decode worker aborts a running sequence; a
prefill stops between chunks and sends PrefillDone(ok=False) once no write is in flight, and only
then does the decode worker free the reserved blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import aiohttp
import orjson
import pytest
from kvmesh.shared.bus.messages.codec import decode_message
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from support.mesh_checks import check_blocks_returned, check_equals_offline, load

from kvmesh.testing.mesh import MeshTap, complete, completion_body, local_mesh, random_prompts
from kvmesh.testing.offline import offline_greedy

pytestmark = pytest.mark.slow

CHUNK_TOKENS = 32
ENV = {
    "KVMESH_CHUNK_TOKENS": str(CHUNK_TOKENS),
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_NUM_BLOCKS": "1024",
}
PROMPTS = random_prompts(32, 40, 150, seed=7)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    return offline_greedy(PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module", params=["shm", "tcp"])
def disagg_mesh(request):
    with local_mesh("disagg", request.param, env=ENV, local_prefill_threshold=0) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def colocated_mesh():
    with local_mesh("colocated", env=ENV) as mesh:
        yield mesh


async def _load(mesh) -> tuple[list[dict], MeshTap]:
    # PrefillReports are published after the PrefillDone
    return await load(mesh, PROMPTS, MAX_TOKENS, linger_s=0.1)


async def check_timings(mesh, replies: list[dict], *, local: bool) -> None:
    """The router's per-request stages (GET /v1/kvmesh/timings) cover every reply, add up to its
    TTFT and say where the prefill ran; the decode worker reported its share."""
    async with aiohttp.ClientSession() as s, s.get(f"{mesh.url}/v1/kvmesh/timings") as resp:
        body = await resp.json()
    by_id = {t["request_id"]: t for t in body["requests"]}
    for reply in replies:
        t = by_id[reply["id"]]
        assert t["local_prefill"] is local and t["num_prompt_tokens"] > 0
        assert sum(t[stage] for stage in body["stages"]) == pytest.approx(t["ttft_s"], abs=1e-6)
        assert t["prefill_s"] > 0  # compute on the prefill worker; chunks on the colocated one
        if local:
            assert t["transfer_s"] == t["admit_s"] == 0


async def test_disagg_greedy_output_equals_offline_engine(disagg_mesh, offline_tokens):
    replies, tap = await _load(disagg_mesh)
    check_equals_offline(replies, tap, offline_tokens)
    for prompt, reply in zip(PROMPTS, replies, strict=True):
        report = tap.reports[reply["id"]]  # every prompt was prefilled remotely
        assert report.num_chunks >= math.ceil(len(prompt) / CHUNK_TOKENS) >= 2
        assert report.transfer_s > 0 and report.compute_s > 0
        done = tap.prefill_done[reply["id"]]
        assert done.ok and done.num_writes == report.num_chunks
    await check_blocks_returned(disagg_mesh)
    async with aiohttp.ClientSession() as s, s.get(f"{disagg_mesh.url}/metrics") as resp:
        metrics = await resp.text()
    # every write came with its lease's key: nothing refused, nothing stray
    assert 'kvmesh_decode_refused_accesses_total{worker="decode-0"} 0' in metrics
    assert 'kvmesh_decode_stray_immediates_total{worker="decode-0"} 0' in metrics
    await check_timings(disagg_mesh, replies, local=False)


async def test_colocated_greedy_output_equals_offline_engine(colocated_mesh, offline_tokens):
    replies, tap = await _load(colocated_mesh)
    check_equals_offline(replies, tap, offline_tokens)
    assert not tap.reports and not tap.prefill_done  # nothing went through a prefill worker
    await check_blocks_returned(colocated_mesh)
    await check_timings(colocated_mesh, replies, local=True)


async def test_request_waits_while_the_only_worker_is_drained_and_runs_once_resumed(colocated_mesh):
    from kvmesh.shared.bus.admin_client import admin_client

    prompt = PROMPTS[0]
    async with (
        admin_client(colocated_mesh.config.nats_url, auth=colocated_mesh.nats_auth) as admin,
        aiohttp.ClientSession() as s,
    ):
        [worker] = (await admin.status()).decode
        reply = await admin.drain(worker.worker_id)
        assert reply.ok and reply.state == "draining"
        waiting = asyncio.create_task(complete(s, colocated_mesh.url, prompt, 2))
        await asyncio.sleep(1.5)
        assert not waiting.done()  # accepted and queued, neither refused nor placed
        assert (await admin.status()).decode[0].load.num_running == 0
        reply = await admin.resume(worker.worker_id)
        assert reply.ok and reply.state == "ready"
        done = await asyncio.wait_for(waiting, 30)
        assert done["usage"]["completion_tokens"] == 2


async def test_drained_prefill_worker_takes_no_job_and_long_prompts_still_run(disagg_mesh):
    """`kvmesh admin drain prefill-0`: the prefill worker stops taking jobs; with no prefill
    worker ready the router prefills long prompts on the decode worker; resume brings it back."""
    from kvmesh.shared.bus.admin_client import admin_client

    async with (
        admin_client(disagg_mesh.config.nats_url, auth=disagg_mesh.nats_auth) as admin,
        MeshTap(disagg_mesh.config.nats_url, disagg_mesh.nats_auth) as tap,
        aiohttp.ClientSession() as s,
    ):
        reply = await admin.drain("prefill-0")
        assert reply.ok and reply.state == "draining"
        await _wait_ready_prefill_workers(s, disagg_mesh.url, 0)  # its heartbeat said draining
        body = await complete(s, disagg_mesh.url, PROMPTS[0], 2)
        assert body["usage"]["completion_tokens"] == 2
        assert body["id"] not in tap.reports  # no prefill worker computed it
        assert (await admin.resume("prefill-0")).state == "ready"
        await _wait_ready_prefill_workers(s, disagg_mesh.url, 1)  # as the module found it
    assert disagg_mesh.nats_violations() == []


async def _wait_ready_prefill_workers(
    session: aiohttp.ClientSession, url: str, num: int, timeout_s: float = 20.0
) -> None:
    """Until the router's /health counts ``num`` ready prefill workers (it learns their state
    from their heartbeats)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with session.get(f"{url}/health") as resp:
            health = await resp.json()
        if health.get("prefill_workers") == num:
            return
        assert asyncio.get_running_loop().time() < deadline, health
        await asyncio.sleep(0.1)


# --- a client that goes away (on the shm mesh of the tests above) ------------------------------


async def _stream_until(session, url: str, prompt: list[int], enough) -> str:
    """Stream a long generation; close the connection once ``enough(request_id)`` holds."""
    body = completion_body(prompt, 2000, ignore_eos=True, stream=True)
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                request_id = orjson.loads(line[6:])["id"]
                if enough(request_id):
                    return request_id  # leaving the block closes the connection
    raise AssertionError("the stream ended before the client disconnected")


@pytest.mark.parametrize("disagg_mesh", ["shm"], indirect=True)
async def test_cancel_mid_stream_aborts_decode_and_returns_blocks(disagg_mesh):
    mesh = disagg_mesh
    [prompt] = random_prompts(1, 100, 100, seed=3)
    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        rid = await _stream_until(session, mesh.url, prompt, lambda r: len(tap.tokens[r]) >= 5)
        final = await tap.wait_finished(rid, timeout_s=20)
        assert final.finish_reason == "abort"
        assert 5 <= len(tap.tokens[rid]) < 2000
    await check_blocks_returned(mesh)  # and no role overstepped its NATS permissions


@pytest.mark.parametrize("disagg_mesh", ["shm"], indirect=True)
async def test_disconnect_mid_prefill_stops_prefill_and_returns_blocks(disagg_mesh):
    mesh = disagg_mesh
    [prompt] = random_prompts(1, 4000, 4000, seed=4)  # 125 chunks of 32 tokens
    job_seen = asyncio.Event()
    async with (
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        connect_nats(mesh.config.nats_url, "test-jobs", auth=mesh.nats_auth) as nc,
        aiohttp.ClientSession() as session,
    ):
        jobs: list[PrefillJob] = []

        async def on_job(msg) -> None:
            jobs.append(decode_message(msg.data, PrefillJob))
            job_seen.set()

        jobs_subject = Subjects(DEFAULT_MESH).PREFILL_JOBS
        await nc.subscribe(jobs_subject, cb=on_job)  # a copy, outside the queue group
        await flush_to_server(nc)
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
        num_chunks = -(-len(prompt) // CHUNK_TOKENS)
        assert 1 <= done.num_writes < num_chunks  # it stopped between chunks
        assert rid not in tap.reports or tap.reports[rid].num_chunks < num_chunks
    await check_blocks_returned(mesh)  # the test's own job subscription (as admin) is allowed
    # the prefill and decode workers are fine afterwards
    async with aiohttp.ClientSession() as session:
        reply = await complete(session, mesh.url, random_prompts(1, 80, 80, seed=5)[0], 4)
        assert reply["usage"]["completion_tokens"] == 4
