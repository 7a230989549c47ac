"""StoreWriter (shared/mesh/kv_store_writer.py), the background puts that prefill and decode
workers share, against an in-process store (tests/support/fake_stores.py): the cached full blocks
of a sequence land in the store, pinned only while the put is in flight; a put that fails forgets
its store and still unpins; with no store nothing is put."""

from __future__ import annotations

import asyncio

from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.prefix_hash import prefix_block_hashes
from kvmesh.shared.mesh.kv_store_writer import StoreWriter
from kvmesh.shared.text.sampling import SamplingOptions
from support.fake_stores import FakeStore, OneStore

BS = 16

PROMPT = [(5 * i + 2) % 200 + 1 for i in range(3 * BS + 5)]  # 3 full blocks and a partial one


def cached_engine(tiny_float32) -> LLMEngine:
    """An engine whose prefix cache holds PROMPT's full blocks (one token generated)."""
    engine = LLMEngine(*tiny_float32, EngineConfig(num_blocks=16, block_size=BS))
    engine.generate([PROMPT], SamplingOptions(max_tokens=1, temperature=0.0))
    return engine


def writer_of(engine: LLMEngine, store: FakeStore, stores: OneStore) -> StoreWriter:
    return StoreWriter(store, stores, engine.kv_spec, engine)  # type: ignore[arg-type]


async def test_the_cached_full_blocks_are_put_and_unpinned_after(tiny_float32) -> None:
    engine = cached_engine(tiny_float32)
    bm = engine.block_manager
    store, stores = FakeStore(engine.kv_pool.raw, engine.kv_pool.spec.block_bytes), OneStore()
    writer = writer_of(engine, store, stores)
    free = bm.num_free_blocks
    writer.put_later(PROMPT, asyncio.Lock())
    await writer.aclose()
    assert set(store.blocks) == set(prefix_block_hashes(PROMPT, BS, bm.root_of("")))
    assert len(store.blocks) == 3 and stores.live
    assert bm.num_free_blocks == free  # the pins were dropped


async def test_a_failed_put_forgets_its_store_and_unpins(tiny_float32) -> None:
    engine = cached_engine(tiny_float32)
    bm = engine.block_manager
    raw, block_bytes = engine.kv_pool.raw, engine.kv_pool.spec.block_bytes
    store, stores = FakeStore(raw, block_bytes, fail_puts=True), OneStore()
    writer = writer_of(engine, store, stores)
    free = bm.num_free_blocks
    writer.put_later(PROMPT, asyncio.Lock())
    await writer.aclose()
    assert not stores.live and store.blocks == {}
    assert bm.num_free_blocks == free
    writer.put_later(PROMPT, asyncio.Lock())  # no store left: nothing is started
    await writer.aclose()
    assert store.blocks == {}
