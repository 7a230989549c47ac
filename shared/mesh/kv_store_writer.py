"""An engine's cached blocks put into a kv-store (docs/kv_store.md), and the one background
writer the engine workers share: a prefill worker puts a prompt's blocks after computing it, a
decode worker a finished request's.

A put reads pool blocks that the engine could evict meanwhile, so they are pinned (one more
reference, under the engine lock) before and unpinned after, whatever the put's outcome:
``pin_cached_prefix`` then ``put_pinned``, or both at once, ``put_cached_prefix``.

``StoreWriter.put_later`` picks the store (``StoreBook.target``) and returns at once; a task pins
the cached full blocks of the tokens, puts them and unpins them. Best effort: a put that fails
forgets its store until the store's next advert, a refused one is logged, and a step never waits
for a put. ``aclose`` waits for the puts in flight (they pin pool blocks); the client is its
owner's to close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.prefix_hash import prefix_block_hashes
from kvmesh.shared.mesh.kv_store_client import (
    KvStoreClient,
    PutResult,
    StoreTarget,
    local_blocks,
)
from kvmesh.shared.mesh.kv_store_prefix import PoolIo
from kvmesh.shared.mesh.store_book import StoreBook
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """The leading full blocks of ``token_ids`` that the prefix cache held, each pinned (one
    more reference) until the put that reads them ends: ``block_ids[i]`` holds ``hashes[i]``."""

    token_ids: tuple[int, ...]
    hashes: list[int]
    block_ids: list[int]


def pin_cached_prefix(
    block_manager: BlockManager, block_size: int, token_ids: Sequence[int], cache_salt: str = ""
) -> PinnedPrefix | None:
    """Pin the full blocks of ``token_ids`` (of a request salted with ``cache_salt``) that the
    prefix cache holds (the leading run); the caller holds the engine lock. None when none is
    cached."""
    hashes = prefix_block_hashes(token_ids, block_size, block_manager.root_of(cache_salt))
    pinned = block_manager.pin_cached(hashes)
    if not pinned:
        return None
    return PinnedPrefix(tuple(token_ids), hashes[: len(pinned)], pinned)


async def put_pinned(
    io: PoolIo, store: StoreTarget, pinned: PinnedPrefix, lock: asyncio.Lock
) -> PutResult:
    """Put pinned blocks into ``store``, then unpin them (under ``lock``, the engine's), whatever
    the put's outcome. Raises what the put raises."""
    try:
        blocks = local_blocks(
            io.pool, io.kv_spec, pinned.token_ids, pinned.hashes, pinned.block_ids
        )
        return await io.client.put(store, io.kv_spec, blocks)
    finally:
        async with lock:
            io.block_manager.free_blocks(pinned.block_ids)


async def put_cached_prefix(
    io: PoolIo,
    store: StoreTarget,
    token_ids: Sequence[int],
    lock: asyncio.Lock,
    cache_salt: str = "",
) -> PutResult | None:
    """Put the full blocks of ``token_ids`` (of a request salted with ``cache_salt``) that the
    engine's prefix cache holds (the leading run), pinned in the pool (under ``lock``, the
    engine's) while the put reads them, unpinned after. None when none is cached. Raises what
    the put raises."""
    async with lock:
        pinned = pin_cached_prefix(io.block_manager, io.pool.spec.block_size, token_ids, cache_salt)
    if pinned is None:
        return None
    return await put_pinned(io, store, pinned, lock)


class StoreWriter:
    """One engine's background puts (module docstring) of blocks laid out as ``kv_spec``."""

    def __init__(
        self, client: KvStoreClient, stores: StoreBook, kv_spec: str, engine: LLMEngine
    ) -> None:
        self.io, self.stores = PoolIo.of(client, kv_spec, engine), stores
        self._puts: set[asyncio.Task[None]] = set()

    def put_later(self, token_ids: Sequence[int], lock: asyncio.Lock, cache_salt: str = "") -> None:
        """Put the cached full blocks of ``token_ids`` (named under ``cache_salt``) into the
        store in the background, pinned under ``lock`` (the engine's) while the put reads them.
        Nothing when no store is known."""
        store = self.stores.target()
        if store is None:
            return
        task = asyncio.ensure_future(self._put(store, token_ids, lock, cache_salt))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(
        self, store: StoreTarget, token_ids: Sequence[int], lock: asyncio.Lock, cache_salt: str
    ) -> None:
        try:
            result = await put_cached_prefix(self.io, store, token_ids, lock, cache_salt)
        except Exception as exc:  # best effort: the store misses these blocks
            log.warning("kv-store put failed", error=str(exc))
            self.stores.forget(store.store_id)
            return
        if result is not None and not result.ok:
            log.info("kv-store put refused", error=result.error)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they pin pool blocks)."""
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
