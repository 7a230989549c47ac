"""fetch_prefix and adopt_fetched (shared/mesh/kv_store_prefix.py) against a block manager and a
store that answers in this process: which blocks a read goes into, what ends up cached."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.kv.prefix_hash import reusable_prefix_hashes
from kvmesh.shared.mesh.kv_store_client import GetResult
from kvmesh.shared.mesh.kv_store_prefix import PoolIo, adopt_fetched, fetch_prefix

BS = 4


@dataclass
class Spec:
    block_size: int = BS


class Pool:
    spec = Spec()

    def block_offset(self, block_id: int) -> int:
        return block_id * 1024


class AllThere:
    """A store holding every block asked for (the bytes are not this test's subject)."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    async def get(self, store, kv_spec, blocks) -> GetResult:
        self.asked += [b.offset // 1024 for b in blocks]
        return GetResult(len(blocks), len(blocks))


def cache(bm: BlockManager, h: int, tokens: tuple[int, ...]) -> int:
    """A free block holding ``h`` in the prefix cache (at the back of the free list)."""
    (block,) = bm.allocate_blocks(1)
    bm.adopt([block], [h], [tokens])
    bm.free_blocks([block])
    return block


def test_fetch_never_evicts_the_cached_blocks_the_read_continues():
    bm = BlockManager(4, BS)
    tokens = list(range(17))  # 4 reusable blocks
    hashes = reusable_prefix_hashes(tokens, BS)
    first = cache(bm, hashes[0], tuple(tokens[:BS]))  # the prefix's head, cached...
    cache(bm, 999, (9, 9, 9, 9))  # ... and freed before an unrelated cached block
    store = AllThere()
    fetched = asyncio.run(
        fetch_prefix(PoolIo(store, "", bm, Pool()), None, tokens, asyncio.Lock())  # type: ignore[arg-type]
    )
    assert fetched is not None and fetched.num_cached == 1 and fetched.pinned == (first,)
    assert first not in store.asked and len(store.asked) == 3
    assert adopt_fetched(bm, fetched) == 3 * BS
    assert bm.num_cached(hashes) == 4 and bm.num_free_blocks == 4
    bm.check_invariants()


def test_fetch_of_a_cached_prefix_reads_nothing_and_pins_nothing():
    bm = BlockManager(4, BS)
    tokens = list(range(9))  # 2 reusable blocks
    hashes = reusable_prefix_hashes(tokens, BS)
    cache(bm, hashes[0], tuple(tokens[:BS]))
    cache(bm, hashes[1], tuple(tokens[BS : 2 * BS]))
    fetched = asyncio.run(
        fetch_prefix(PoolIo(AllThere(), "", bm, Pool()), None, tokens, asyncio.Lock())  # type: ignore[arg-type]
    )
    assert fetched is None and bm.num_free_blocks == 4
    bm.check_invariants()
