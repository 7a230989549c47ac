"""A decode worker's local prefills read their prefix from a kv-store (DecodeWorker with a
PrefixReader, shared/mesh/kv_store_prefix.py), driven as the service drives it, against an
in-process store that copies blocks (the data plane's part is the mesh test's,
tests/mesh/test_mesh_kv_store_local.py): the prefix read is adopted and not computed, the output
equals the offline engine's, and a request aborted while its prefix is read frees every block."""

from __future__ import annotations

import asyncio

from kvmesh.services.decode.local_reads import LocalPrefixReads
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.mesh.kv_store_prefix import PoolIo, PrefixReader
from kvmesh.shared.mesh.kv_store_writer import put_cached_prefix
from kvmesh.shared.text.sampling import SamplingOptions
from support.fake_stores import FakeStore, OneStore

BS = 16
PREFIX = [(7 * i + 3) % 250 + 1 for i in range(8 * BS)]  # 8 blocks
FIRST = [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6]
SECOND = [*PREFIX, 2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # 8 blocks read, 12 tokens computed
MAX_TOKENS = 8
OPTS = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def worker_of(tiny, store: FakeStore | None = None) -> tuple[DecodeWorker, FakeStore]:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=64, block_size=BS))
    pool = engine.kv_pool
    store = store or FakeStore(pool.raw, pool.spec.block_bytes)
    store.raw = pool.raw  # the fake store copies from and into this worker's pool
    reader = PrefixReader(PoolIo.of(store, engine.kv_spec, engine), OneStore())
    lock, wake = asyncio.Lock(), asyncio.Event()  # the engine's and the loop's, as composed
    reads = LocalPrefixReads(reader, lock, wake)
    worker = DecodeWorker(
        engine, worker_id="d0", base_addr=pool.base_addr, lock=lock, wake=wake, reads=reads
    )
    return worker, store


async def ask(worker: DecodeWorker, rid: str, prompt: list[int]) -> list[int]:
    reply = await worker.reserve(ReserveRequest(rid, tuple(prompt), OPTS, True, rid, 1))
    assert reply.ok, reply.error
    got: list[int] = []
    for _ in range(10_000):
        if worker.is_idle:
            break
        await asyncio.sleep(0)  # the read runs on the loop
        for event in await worker.admit() + await worker.step():
            assert event.request_id == rid and not event.error
            got += event.token_ids
    assert worker.is_idle
    return got


def counted(worker: DecodeWorker, name: str) -> float:
    value = worker.metrics.registry.get_sample_value(f"kvmesh_decode_{name}_total")
    return value or 0.0


async def test_local_prefill_adopts_the_stored_prefix_and_computes_only_the_rest(tiny) -> None:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    offline = LLMEngine(*tiny, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    params = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = [offline.generate([p], params)[0] for p in (FIRST, SECOND)]

    first, store = worker_of(tiny)
    assert await ask(first, "r1", FIRST) == expected[0]
    engine = first.engine
    put = await put_cached_prefix(
        PoolIo.of(store, engine.kv_spec, engine), None, FIRST, asyncio.Lock()
    )
    assert put is not None and len(put.committed) == 8
    assert counted(first, "store_hit_tokens") == 0  # the store was empty for it

    second, _ = worker_of(tiny, store)  # never saw the prefix: reads it
    assert await ask(second, "r2", SECOND) == expected[1]
    assert store.num_read == 8
    assert counted(second, "local_prompt_tokens") == len(SECOND)
    assert counted(second, "store_hit_tokens") == 8 * BS
    assert second.engine.block_manager.num_hit_tokens == 8 * BS  # computed only 12
    bm = second.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks


class HeldStore(FakeStore):
    """A FakeStore whose gets wait for ``release``."""

    def __init__(self, raw, block_bytes: int) -> None:
        super().__init__(raw, block_bytes)
        self.release = asyncio.Event()
        self.asked = asyncio.Event()

    async def get(self, store, kv_spec, blocks):
        self.asked.set()
        await self.release.wait()
        return await super().get(store, kv_spec, blocks)


async def test_request_aborted_while_its_prefix_is_read_frees_every_block(tiny) -> None:
    first, store = worker_of(tiny)
    await ask(first, "r1", FIRST)
    engine = first.engine
    await put_cached_prefix(PoolIo.of(store, engine.kv_spec, engine), None, FIRST, asyncio.Lock())
    held = HeldStore(None, store.block_bytes)
    held.blocks = store.blocks
    second, _ = worker_of(tiny, held)
    reply = await second.reserve(ReserveRequest("r2", tuple(SECOND), OPTS, True, "r2", 1))
    assert reply.ok
    await held.asked.wait()  # the read is in flight, its blocks taken from the pool
    bm = second.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks - 8
    event = second.abort("r2")
    assert event is not None and event.finish_reason == "abort"
    assert not second.is_idle  # the read still holds blocks
    held.release.set()
    for _ in range(100):
        await asyncio.sleep(0)
        assert await second.admit() == []
        if second.is_idle:
            break
    assert second.is_idle and "r2" not in second.engine.seqs
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_total_blocks
    assert bm.num_cached(list(bm.hash_to_block)) == 8  # what it read stays cached
