"""Reading a sequence's prefix blocks from a kv-store into an engine's prefix cache (asyncio;
docs/kv_store.md). What every engine worker that reads a store shares: a prefill worker before
it computes a prompt, a decode worker before it readmits a sequence it swapped out.

Two halves, so that the engine lock is never held across I/O: ``fetch_prefix`` allocates free
pool blocks for the hashes the prefix cache lacks (under the lock) and reads the store's copies
into them one-sided (without it); ``adopt_fetched``, called under the lock right before the
engine allocates the sequence, enters the verified blocks into the prefix cache and frees every
fetched block, so the engine takes them as prefix hits and computes only the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.kv.prefix_hash import reusable_prefix_hashes
from kvmesh.shared.mesh.kv_store_client import KvStoreClient, StoreTarget, local_blocks
from kvmesh.shared.mesh.store_book import StoreBook
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PoolIo:
    """One engine's KV pool as store puts and gets move it: ``client`` carries blocks laid out
    as ``kv_spec`` between ``pool`` and a store; ``block_manager`` owns the pool's blocks (pins,
    allocations, the prefix cache)."""

    client: KvStoreClient
    kv_spec: str
    block_manager: BlockManager
    pool: KVPool

    @classmethod
    def of(cls, client: KvStoreClient, kv_spec: str, engine: LLMEngine) -> PoolIo:
        return cls(client, kv_spec, engine.block_manager, engine.kv_pool)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Pool blocks holding a prefix read from a store: ``block_ids[:num_good]`` verified as
    ``hashes[:num_good]``; all of ``block_ids`` are the caller's to adopt and free.
    ``num_cached``: the leading blocks the prefix cache held already (not read), ``pinned``
    meanwhile (so that allocating the others could not evict them; freed by the adopt).
    ``failed``: the store did not answer or the transfer failed (the caller may forget it)."""

    block_ids: list[int]
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    num_good: int
    num_cached: int = 0
    failed: bool = False
    pinned: tuple[int, ...] = ()


async def fetch_prefix(
    io: PoolIo,
    store: StoreTarget,
    token_ids: Sequence[int],
    lock: asyncio.Lock,
    max_blocks: int | None = None,
    cache_salt: str = "",
) -> Fetched | None:
    """Read the reusable prefix blocks of ``token_ids`` (all full blocks but the one holding
    the last token; at most ``max_blocks`` of them; named under ``cache_salt``, the request's)
    that the prefix cache lacks from ``store``
    into fresh pool blocks, allocated under ``lock`` and read without it. None when there is
    nothing to read or no room for it. Never raises for the store's sake: a failed get reads
    nothing (``failed``)."""
    client, kv_spec, block_manager, pool = io.client, io.kv_spec, io.block_manager, io.pool
    bs = pool.spec.block_size
    hashes = reusable_prefix_hashes(token_ids, bs, block_manager.root_of(cache_salt))
    if max_blocks is not None:
        hashes = hashes[:max_blocks]
    async with lock:
        # the cached leading blocks are pinned: the fresh ones are taken from the free list,
        # where they may sit too, and evicting them would break the prefix the read continues
        pinned = tuple(block_manager.pin_cached(hashes))
        first = len(pinned)
        want = len(hashes) - first
        if want <= 0 or want > block_manager.num_free_blocks:
            block_manager.free_blocks(list(pinned))
            return None
        block_ids = block_manager.allocate_blocks(want)
    blocks = local_blocks(pool, kv_spec, token_ids, hashes[first:], block_ids, first)
    tokens = [tuple(token_ids[i * bs : (i + 1) * bs]) for i in range(first, len(hashes))]
    try:
        result = await client.get(store, kv_spec, blocks)
    except Exception as exc:  # best effort: a failed read means computing the prefix
        log.warning("kv-store get failed", error=str(exc))
        return Fetched(block_ids, hashes[first:], tokens, 0, first, True, pinned)
    if result.error:
        log.info("kv-store get used fewer blocks", error=result.error)
    return Fetched(block_ids, hashes[first:], tokens, result.num_blocks, first, False, pinned)


def adopt_fetched(block_manager: BlockManager, fetched: Fetched) -> int:
    """Under the engine lock, right before the sequence is allocated: the verified blocks enter
    the prefix cache, every fetched block is freed and the cached ones unpinned (the chain's
    tail first, so its head stays longest). Returns the tokens adopted."""
    n = fetched.num_good
    block_manager.adopt(fetched.block_ids[:n], fetched.hashes[:n], fetched.tokens[:n])
    block_manager.free_blocks([*fetched.pinned, *fetched.block_ids])
    return n * block_manager.block_size


@dataclass(eq=False)
class PrefixReader:
    """One engine's reads of prompt prefixes from the store ``stores`` picks (prefill workers
    before a job, decode workers before a local prefill): ``fetch`` without the engine lock held
    across I/O, then ``adopt`` under it right before the request is added. A store whose get
    failed is forgotten until its next advert."""

    io: PoolIo
    stores: StoreBook

    async def fetch(
        self, token_ids: Sequence[int], lock: asyncio.Lock, cache_salt: str = ""
    ) -> Fetched | None:
        """``fetch_prefix`` from the chosen store; None: no store, nothing to read, no room."""
        store = self.stores.target()
        if store is None:
            return None
        fetched = await fetch_prefix(self.io, store, token_ids, lock, cache_salt=cache_salt)
        if fetched is not None and fetched.failed:
            self.stores.forget(store.store_id)
        return fetched

    def adopt(self, fetched: Fetched) -> int:
        """``adopt_fetched`` (under the engine lock); returns the tokens adopted."""
        return adopt_fetched(self.io.block_manager, fetched)
