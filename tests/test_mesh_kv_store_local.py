"""Local prefills read the kv-store (`kvmesh up --kv-store 1`, two decode workers, kvmesh-tiny,
shm): the router hands every request to a decode worker to prefill itself
(`--local-prefill-threshold` above every prompt).

decode-0 prefills the first request (136 tokens) itself, computing all of it (the store is
empty), and puts the finished sequence's 10 full blocks into the store. With decode-0 drained,
a second request sharing the first one's 128-token prefix goes to decode-1, which has never
seen it: it reads the prefix's 8 blocks one-sided from the store into its prefix cache and
computes only the 12 other tokens, as counted by its own metrics
(`kvmesh_decode_local_prompt_tokens_total`, `kvmesh_decode_store_hit_tokens_total`,
`kvmesh_decode_prefix_cache_hit_tokens_total`). Both outputs equal the offline engine's.
"""

from __future__ import annotations

import asyncio
import urllib.request

import aiohttp
import pytest
from kvmesh.loadgen.bench_mesh import MeshTap, complete, launched, random_prompts
from kvmesh.loadgen.server_breakdown import parse_prometheus
from kvmesh.shared.admin_client import admin_client
from mesh_checks import store_advertised_since_ready

pytestmark = pytest.mark.slow

BLOCK_BYTES = 64 << 10  # kvmesh-tiny, 16-token blocks, float32
ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    "KVMESH_KV_CACHE_BYTES": str(256 * BLOCK_BYTES),
    "KVMESH_CHUNK_TOKENS": "64",
}
PREFIX = random_prompts(1, 128, 128, seed=31)[0]  # 8 blocks
FIRST = [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6]  # 136 tokens, computed by decode-0
SECOND = [*PREFIX, 2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # 140: 128 read from the store, 12 computed
MAX_TOKENS = 40  # FIRST + its answer: 175 tokens with KV, 10 full blocks put


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.engine.sequence import SamplingParams
    from kvmesh.shared.model.loader import load_model

    model, tokenizer = load_model("kvmesh-tiny")
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=256, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [engine.generate([p], params)[0] for p in (FIRST, SECOND)]


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return parse_prometheus(resp.read().decode())


async def run(mesh, offline: list[list[int]]) -> None:
    await store_advertised_since_ready(mesh)  # both decode workers know where to put and read
    async with (
        admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin,
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):

        async def ask(prompt: list[int]) -> list[int]:
            body = await complete(session, mesh.url, prompt, MAX_TOKENS, ignore_eos=True)
            await tap.wait_finished(body["id"])
            assert body["id"] not in tap.prefill_done  # prefilled by the decode worker
            return tap.tokens[body["id"]]

        async def stored_blocks(at_least: int) -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30.0
            while True:  # a barrier on the store's adverts (the puts run in the background)
                rows = (await admin.status())["stores"]
                if rows and rows[0]["used_blocks"] >= at_least:
                    return
                assert loop.time() < deadline, f"the store holds fewer blocks: {rows}"
                await asyncio.sleep(0.1)

        await admin.drain("decode-1")
        first = await ask(FIRST)
        await stored_blocks(10)
        await admin.resume("decode-1")
        await admin.drain("decode-0")
        second = await ask(SECOND)
        assert [first, second] == offline
    d0, d1 = scrape(mesh.metrics_urls["decode-0"]), scrape(mesh.metrics_urls["decode-1"])
    store = scrape(mesh.metrics_urls["kv-store-0"])
    assert d0["kvmesh_decode_local_prompt_tokens_total"] == len(FIRST)
    assert d0["kvmesh_decode_prefix_cache_hit_tokens_total"] == 0  # computed all of it
    assert d1["kvmesh_decode_local_prompt_tokens_total"] == len(SECOND)
    assert d1["kvmesh_decode_store_hit_tokens_total"] == 128
    assert d1["kvmesh_decode_prefix_cache_hit_tokens_total"] == 128  # computed only 12
    assert store["kvmesh_store_hits_total"] == 8
    assert store["kvmesh_store_rejected_blocks_total"] == 0


@pytest.mark.timeout(300)
def test_local_prefill_on_a_decode_worker_reads_the_stored_prefix_and_computes_only_the_rest(
    offline_tokens: list[list[int]],
) -> None:
    from kvmesh.commands.up import UpConfig, free_port

    config = UpConfig(
        mode="disagg",
        transport="shm",
        port=0,
        nats_url=f"nats://127.0.0.1:{free_port()}",
        local_prefill_threshold=1 << 20,
        prefill=1,
        decode=2,
        kv_store=1,
        kv_store_capacity_gb=0.0625,
        log_level="warning",
        startup_timeout_s=180.0,
        stop_timeout_s=10.0,
    )
    with launched(config, ENV) as mesh:
        asyncio.run(run(mesh, offline_tokens))
