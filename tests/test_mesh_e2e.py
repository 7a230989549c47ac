"""End to end: real nats-server, kv-registry, router, prefill and decode processes (kvmesh-tiny).

32 concurrent greedy requests through the router's HTTP API; the tokens each request got (read
off its NATS token subject, keyed by the response id) must equal the offline engine's
(LLMEngine.generate) token for token, disaggregated over shm and over tcp, and colocated. Prompts
span several prefill chunks (chunk budget 32 tokens, blocks of 16). After the load every decode
worker has all its blocks free again.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
import pytest
from kvmesh.loadgen.bench_mesh import MeshTap, complete, local_mesh, random_prompts
from mesh_checks import check_blocks_returned, check_equals_offline, load, offline_greedy

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


async def test_colocated_greedy_output_equals_offline_engine(colocated_mesh, offline_tokens):
    replies, tap = await _load(colocated_mesh)
    check_equals_offline(replies, tap, offline_tokens)
    assert not tap.reports and not tap.prefill_done  # nothing went through a prefill worker
    await check_blocks_returned(colocated_mesh)


async def test_request_waits_while_the_only_worker_is_drained_and_runs_once_resumed(colocated_mesh):
    from kvmesh.shared.admin_client import admin_client

    prompt = PROMPTS[0]
    async with (
        admin_client(colocated_mesh.config.nats_url, auth=colocated_mesh.nats_auth) as admin,
        aiohttp.ClientSession() as s,
    ):
        [worker] = (await admin.status())["decode"]
        reply = await admin.drain(worker["worker_id"])
        assert reply["ok"] and reply["state"] == "draining"
        waiting = asyncio.create_task(complete(s, colocated_mesh.url, prompt, 2))
        await asyncio.sleep(1.5)
        assert not waiting.done()  # accepted and queued, neither refused nor placed
        assert (await admin.status())["decode"][0]["running"] == 0
        reply = await admin.resume(worker["worker_id"])
        assert reply["ok"] and reply["state"] == "ready"
        done = await asyncio.wait_for(waiting, 30)
        assert done["usage"]["completion_tokens"] == 2


async def test_drained_prefill_worker_takes_no_job_and_long_prompts_still_run(disagg_mesh):
    """`kvmesh admin drain prefill-0`: the prefill worker stops taking jobs; with no prefill
    worker ready the router prefills long prompts on the decode worker; resume brings it back."""
    from kvmesh.shared.admin_client import admin_client

    async with (
        admin_client(disagg_mesh.config.nats_url, auth=disagg_mesh.nats_auth) as admin,
        MeshTap(disagg_mesh.config.nats_url, disagg_mesh.nats_auth) as tap,
        aiohttp.ClientSession() as s,
    ):
        reply = await admin.drain("prefill-0")
        assert reply["ok"] and reply["state"] == "draining"
        await asyncio.sleep(4)  # the router sees its heartbeat say draining
        body = await complete(s, disagg_mesh.url, PROMPTS[0], 2)
        assert body["usage"]["completion_tokens"] == 2
        assert body["id"] not in tap.reports  # no prefill worker computed it
        assert (await admin.resume("prefill-0"))["state"] == "ready"
    assert disagg_mesh.nats_violations() == []
