"""Background puts into a kv-store (docs/kv_store.md), the one writer the engine workers share: a
prefill worker puts a prompt's blocks after computing it, a decode worker a finished request's.

``put_later`` picks the store (``StoreBook.target``) and returns at once; a task pins the cached
full blocks of the tokens (under the engine lock), puts them and unpins them. Best effort: a put
that fails forgets its store until the store's next advert, a refused one is logged, and a step
never waits for a put. ``aclose`` waits for the puts in flight (they pin pool blocks); the client
is its owner's to close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import (
    KvStoreClient,
    StoreBook,
    StoreTarget,
    put_cached_prefix,
)
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


class StoreWriter:
    """One engine's background puts (module docstring) of blocks laid out as ``kv_spec``."""

    def __init__(
        self, client: KvStoreClient, stores: StoreBook, kv_spec: str, engine: LLMEngine
    ) -> None:
        self.client, self.stores, self.kv_spec, self.engine = client, stores, kv_spec, engine
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
        engine = self.engine
        where = (self.client, store, self.kv_spec, engine.block_manager, engine.kv_pool)
        try:
            result = await put_cached_prefix(*where, token_ids, lock, cache_salt)
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
