"""A kv-store in the mesh (`kvmesh up --kv-store 1`): real nats-server, kv-registry, router, one
decode and two prefill workers and a store (kvmesh-tiny, shm).

prefill-1 drained, the first request is prefilled by prefill-0, which then puts the prompt's 8
full blocks into the store. prefill-0 drained and prefill-1 resumed, a second request sharing the
first one's 128-token prefix is prefilled by prefill-1, which has never seen it: it reads the 8
blocks one-sided from the store into its prefix cache and computes only the 12 other tokens.
The decode worker puts every finished request's blocks, prompt and output, into the store, so
the second turn of that conversation (its prompt, its 40 output tokens and 12 new ones) has 11
of its 12 blocks read or cached: prefill-1 reads the 3 blocks of the first answer from the store
and computes only 16 tokens (the answer's last token, whose KV decode never computed, and the
new ones). Tokens are counted by prefill-1's engine as it allocates
(`kvmesh_prefill_prefix_hit_tokens_total`) and by its store reads; every output equals the
offline engine's, token for token, also that of a request asked for once the store is killed.
The store reports the blocks it holds to the kv-registry (KV events), whose placement counts
how many leading blocks of each prompt it holds: 8 of the second request's, 11 of the turn's.
The registry never hands a request to the decode worker's own cache
(`--local-max-suffix-tokens 0`), so every suffix really is a remote prefill.
"""

from __future__ import annotations

import asyncio

import pytest
from support.mesh_checks import (
    STORE_MESH_ENV,
    one_by_one,
    poll_status,
    scrape,
    store_advertised_since_ready,
    store_mesh_config,
)

from kvmesh.testing.mesh import launched, random_prompts
from kvmesh.testing.offline import offline_greedy_each

pytestmark = pytest.mark.slow

ENV = {**STORE_MESH_ENV, "KVMESH_LOCAL_MAX_SUFFIX_TOKENS": "0"}
PREFIX = random_prompts(1, 128, 128, seed=23)[0]  # 8 blocks
FIRST = [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6]  # 136 tokens: 8 full blocks put after its prefill
SECOND = [*PREFIX, 2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # 140: 8 blocks from the store, 12 computed
NEW = [9, 9, 8, 2, 4, 4, 3, 5, 3, 6, 6, 1]  # the second turn's new tokens
LAST = random_prompts(1, 100, 100, seed=29)[0]  # asked for while the store is dead
MAX_TOKENS = 40  # SECOND + its answer: 180 tokens, 179 with KV: 11 full blocks


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    greedy = offline_greedy_each(MAX_TOKENS, ignore_eos=True)
    first, second = greedy(FIRST), greedy(SECOND)
    return [first, second, greedy([*SECOND, *second, *NEW]), greedy(LAST)]


async def wait_store(admin, ready, what: str):
    """The store's admin status row once ``ready(row)`` holds (a barrier, polled)."""
    status = await poll_status(admin, lambda s: any(ready(r) for r in s.stores[:1]), what)
    return status.stores[0]


def prefill_counts(mesh) -> dict[str, dict[str, float]]:
    """Each prefill worker's prompt, prefix-hit and store-hit token counters."""
    names = ("prompt_tokens", "prefix_hit_tokens", "store_hit_tokens")
    out = {}
    for worker in ("prefill-0", "prefill-1"):
        metrics = scrape(mesh.metrics_urls[worker])
        out[worker] = {n: metrics.get(f"kvmesh_prefill_{n}_total", 0.0) for n in names}
    return out


async def run(mesh, offline: list[list[int]]) -> None:
    async with one_by_one(mesh, MAX_TOKENS) as (admin, ask):
        # both prefill workers know the store: one that became ready between two of its
        # adverts has none to read from or put to until the next (a fresh clone's prefill-1
        # read none of SECOND's prefix from it)
        await store_advertised_since_ready(mesh)
        await admin.drain("prefill-1")
        first = await ask(FIRST, remote=True)
        # the registry's index learns them from the store's KV events (placement counts them)
        await wait_store(admin, lambda r: r.indexed_blocks >= 8, "the first prompt's blocks")
        await admin.resume("prefill-1")
        await admin.drain("prefill-0")
        second = await ask(SECOND, remote=True)
        # 8 (prefix) + 2 (the end of the first answer) + 3 (the end of the second)
        await wait_store(admin, lambda r: r.indexed_blocks >= 13, "the answers' blocks")
        third = await ask([*SECOND, *second, *NEW], remote=True)
        assert [first, second, third] == offline[:3]
        try:
            row = await wait_store(
                admin, lambda r: r.load.hits >= 11, "the second turn's store read"
            )
        except AssertionError as exc:  # say which worker prefilled what (a fresh clone saw 3 hits)
            raise AssertionError(f"{exc}; prefill workers: {prefill_counts(mesh)}") from None
        assert (row.load.hits, row.load.refused_accesses) == (11, 0)
        assert row.load.used_blocks >= 13  # and the second turn's own, put after it
        store = scrape(mesh.metrics_urls["kv-store-0"])
        mesh.children["kv-store-0"][1].kill()  # a dead store costs prefills, not requests
        assert await ask(LAST, remote=True) == offline[3]
    registry = scrape(mesh.metrics_urls["kv-registry-0"])
    # placed knowing the store held SECOND's 8 prefix blocks and the second turn's 11
    assert registry["kvmesh_registry_store_matched_tokens_total"] == 128 + 176
    p0, p1 = scrape(mesh.metrics_urls["prefill-0"]), scrape(mesh.metrics_urls["prefill-1"])
    assert p0["kvmesh_prefill_prompt_tokens_total"] == len(FIRST)
    assert p0["kvmesh_prefill_prefix_hit_tokens_total"] == 0  # computed all of it
    assert p1["kvmesh_prefill_prompt_tokens_total"] == len(SECOND) + 192 + len(LAST)
    # SECOND: 128 tokens from the store; the second turn: 128 from its own cache, 48 from the store
    assert p1["kvmesh_prefill_store_hit_tokens_total"] == 128 + 48
    assert p1["kvmesh_prefill_prefix_hit_tokens_total"] == 128 + 176  # computed 12, then 16
    assert store["kvmesh_store_hits_total"] == 11
    assert store["kvmesh_store_rejected_blocks_total"] == 0


@pytest.mark.timeout(300)
def test_prefill_reads_prefixes_and_earlier_answers_from_the_store_and_computes_only_new_tokens(
    offline_tokens: list[list[int]],
) -> None:
    config = store_mesh_config(prefill=2, decode=1)
    with launched(config, ENV) as mesh:
        asyncio.run(run(mesh, offline_tokens))
