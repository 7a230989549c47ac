"""A prefill worker's use of a kv-store (docs/kv_store.md): before a prompt is computed, the
blocks of its prefix that the engine's own prefix cache lacks are read one-sided from a store
into free blocks of the pool and entered into the prefix cache, so the engine computes only the
rest; after it, the prompt's full blocks are put into the store in the background (pinned in
the pool while the write is in flight), for the next worker that sees the prefix.

Best effort throughout: a store that is absent, slow, full or refusing costs a prefill, never a
job. The engine lock is held only to allocate, adopt, pin and free blocks, never across I/O.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvmesh.shared import logs
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv_block_header import token_digests
from kvmesh.shared.kv_store_client import (
    KvStoreClient,
    LocalBlock,
    StoreBook,
    StoreTarget,
    put_cached_prefix,
)
from kvmesh.shared.prefix_hash import reusable_prefix_hashes
from kvmesh.shared.protocol import StoreAdvert

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Pool blocks holding a prefix read from a store: ``block_ids[:num_good]`` verified as
    ``hashes[:num_good]``; all of ``block_ids`` are the caller's to adopt and free."""

    block_ids: list[int]
    hashes: list[int]
    tokens: list[tuple[int, ...]]
    num_good: int


class StorePrefix:
    def __init__(self, engine: LLMEngine, client: KvStoreClient, kv_spec: str) -> None:
        self.engine = engine
        self.client = client
        self.kv_spec = kv_spec
        self.block_size = engine.kv_pool.spec.block_size
        self.stores = StoreBook(kv_spec, client.block_bytes)
        self._puts: set[asyncio.Task[None]] = set()

    def on_advert(self, advert: StoreAdvert) -> None:
        self.stores.note(advert)

    async def fetch(self, prompt_ids: list[int], lock: asyncio.Lock) -> Fetched | None:
        """Read the prompt's prefix blocks the prefix cache lacks from the store into fresh pool
        blocks (allocated under ``lock``, read without it). None when there is nothing to read."""
        store = self.stores.target()
        if store is None:
            return None
        bm = self.engine.block_manager
        hashes = reusable_prefix_hashes(prompt_ids, self.block_size, bm.root_hash)
        async with lock:
            first = bm.num_cached(hashes)
            want = len(hashes) - first
            if want <= 0 or want > bm.num_free_blocks:
                return None
            block_ids = bm.allocate_blocks(want)
        bs = self.block_size
        digests = token_digests(prompt_ids, bs, self.kv_spec, len(hashes))[first:]
        pool = self.engine.kv_pool
        blocks = [
            LocalBlock(h, d, pool.block_offset(b))
            for h, d, b in zip(hashes[first:], digests, block_ids, strict=True)
        ]
        tokens = [tuple(prompt_ids[i * bs : (i + 1) * bs]) for i in range(first, len(hashes))]
        num_good = 0
        try:
            result = await self.client.get(store, self.kv_spec, blocks)
            num_good = result.num_blocks
            if result.error:
                log.info("kv-store get used fewer blocks", error=result.error)
        except Exception as exc:  # best effort: a failed read means computing the prefix
            log.warning("kv-store get failed", error=str(exc))
            self.stores.forget(store.store_id)
        return Fetched(block_ids, hashes[first:], tokens, num_good)

    def adopt(self, fetched: Fetched) -> int:
        """Under the engine lock, right before the request is added: the verified blocks enter
        the prefix cache, every fetched block is freed. Returns the tokens adopted."""
        bm = self.engine.block_manager
        n = fetched.num_good
        bm.adopt(fetched.block_ids[:n], fetched.hashes[:n], fetched.tokens[:n])
        bm.free_blocks(fetched.block_ids)
        return n * self.block_size

    def put_later(self, prompt_ids: list[int], lock: asyncio.Lock) -> None:
        """Put the prompt's computed full blocks into the store in the background."""
        store = self.stores.target()
        if store is None:
            return
        task = asyncio.ensure_future(self._put(store, prompt_ids, lock))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, store: StoreTarget, prompt_ids: list[int], lock: asyncio.Lock) -> None:
        pool, bm = self.engine.kv_pool, self.engine.block_manager
        try:
            result = await put_cached_prefix(
                self.client, store, self.kv_spec, bm, pool, prompt_ids, lock
            )
            if result is not None and not result.ok:
                log.info("kv-store put refused", error=result.error)
        except Exception as exc:  # best effort: the store misses these blocks
            log.warning("kv-store put failed", error=str(exc))
            self.stores.forget(store.store_id)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they hold pool blocks), then close the client."""
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
        await self.client.aclose()
