"""Preempted sequences swapped out to a kv-store and back, in a real mesh (`kvmesh up --kv-store
1`: nats-server, kv-registry, router, one prefill and one decode worker and a store; kvmesh-tiny,
shm).

The decode worker prefills every prompt itself (the router's local-prefill threshold is above
every prompt) in a pool of 14 blocks of 16 tokens, without output room kept back
(`--reserve-output-tokens 0`), and five concurrent requests each grow to 6-7 blocks: it runs out
of blocks and preempts. Each preempted sequence's cached blocks are put into the store, and
when it is readmitted the blocks its pool lost meanwhile are read back from the store
one-sided; the decode worker's /metrics count it (`kvmesh_decode_swap_outs_total`,
`kvmesh_decode_swap_in_tokens_total{source="read"}`), as does the store's (its hits). Every
output equals the offline engine's greedy text, and every block comes back to the pool. The requests go once the
registry has heard a store advert sent after the mesh was ready (the decode worker heard it too:
a worker that knows no store recomputes, and the counts would say so).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from kvmesh.loadgen import prom_text
from support.mesh_checks import (
    TINY_BLOCK_BYTES,
    check_blocks_returned,
    store_advertised_since_ready,
    store_mesh_config,
)

from kvmesh.testing.mesh import complete, launched, random_prompts
from kvmesh.testing.offline import offline_texts

pytestmark = pytest.mark.slow

NUM_BLOCKS = 14
ENV = {
    "KVMESH_BLOCK_SIZE": "16",
    # a pool size in bytes (the kv-store takes --num-blocks too, and its --capacity-gb here)
    "KVMESH_KV_CACHE_BYTES": str(NUM_BLOCKS * TINY_BLOCK_BYTES),
    "KVMESH_RESERVE_OUTPUT_TOKENS": "0",
}
PROMPTS = random_prompts(5, 40, 56, seed=41)  # 3-4 blocks each, 6-7 with their outputs
MAX_TOKENS = 48


def scrape(url: str) -> dict[str, float]:
    """Samples by name, a labelled one as ``name{label="value",...}``."""
    return prom_text.series(prom_text.fetch(url))


async def run(mesh) -> list[str]:
    await store_advertised_since_ready(mesh)
    async with aiohttp.ClientSession() as session:
        bodies = await asyncio.gather(
            *(complete(session, mesh.url, p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS)
        )
    await check_blocks_returned(mesh)  # every pin of a swap-out dropped
    return [b["choices"][0]["text"] for b in bodies]


@pytest.mark.timeout(240)
def test_preempted_sequences_swap_to_the_store_and_back_with_offline_outputs() -> None:
    config = store_mesh_config(prefill=1, decode=1, local_prefill_threshold=4096)
    with ThreadPoolExecutor(1) as offline:  # computed while the mesh starts
        expected = offline.submit(offline_texts, PROMPTS, MAX_TOKENS, 64)
        with launched(config, ENV) as mesh:
            got = asyncio.run(run(mesh))
            decode = scrape(mesh.metrics_urls["decode-0"])
            store = scrape(mesh.metrics_urls["kv-store-0"])
        assert got == expected.result()
    preemptions = decode["kvmesh_decode_preemptions_total"]
    read = decode['kvmesh_decode_swap_in_tokens_total{source="read"}']
    assert preemptions >= 1
    assert decode["kvmesh_decode_swap_outs_total"] >= 1
    assert decode["kvmesh_decode_swap_ins_total"] >= 1
    assert read > 0 and read % 16 == 0
    assert store["kvmesh_store_hits_total"] >= read // 16
    assert store["kvmesh_store_rejected_blocks_total"] == 0
