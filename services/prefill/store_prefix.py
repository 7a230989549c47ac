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
from typing import TYPE_CHECKING

from kvmesh.shared.bus.worker_feature import Feature
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.kv_store_prefix import Fetched, PrefixReader
from kvmesh.shared.mesh.kv_store_writer import StoreWriter
from kvmesh.shared.mesh.store_book import StoreBook

if TYPE_CHECKING:
    from kvmesh.services.prefill.compose import PrefillParts


class StorePrefix(Feature):
    def __init__(self, engine: LLMEngine, client: KvStoreClient, stores: StoreBook) -> None:
        """``client``, ``stores``: the worker's kv-store link's (shared/mesh/store_link.py)."""
        self.engine = engine
        self.client = client
        self.kv_spec = kv_spec = stores.kv_spec
        self.stores = stores
        self.reader = PrefixReader(
            client, self.stores, kv_spec, engine.block_manager, engine.kv_pool
        )
        self.writer = StoreWriter(client, self.stores, kv_spec, engine)

    @classmethod
    def compose(cls, parts: PrefillParts) -> StorePrefix | None:
        link = parts.store_link()
        return cls(parts.engine, link.client, link.stores) if link is not None else None

    async def fetch(
        self, prompt_ids: list[int], lock: asyncio.Lock, cache_salt: str = ""
    ) -> Fetched | None:
        """Read the prompt's prefix blocks (named under the request's ``cache_salt``) the prefix
        cache lacks from the store into fresh pool blocks (allocated under ``lock``, read
        without it). None when there is nothing to read."""
        return await self.reader.fetch(prompt_ids, lock, cache_salt)

    def adopt(self, fetched: Fetched) -> int:
        """Under the engine lock, right before the request is added: the verified blocks enter
        the prefix cache, every fetched block is freed. Returns the tokens adopted."""
        return self.reader.adopt(fetched)

    def put_later(self, prompt_ids: list[int], lock: asyncio.Lock, cache_salt: str = "") -> None:
        """Put the prompt's computed full blocks (named under ``cache_salt``) into the store in
        the background."""
        self.writer.put_later(prompt_ids, lock, cache_salt)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they hold pool blocks; the link closes the client)."""
        await self.writer.aclose()
