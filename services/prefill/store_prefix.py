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

from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import KvStoreClient, StoreBook
from kvmesh.shared.mesh.kv_store_prefix import Fetched, PrefixReader
from kvmesh.shared.mesh.kv_store_writer import StoreWriter


class StorePrefix:
    def __init__(self, engine: LLMEngine, client: KvStoreClient, kv_spec: str) -> None:
        self.engine = engine
        self.client = client
        self.kv_spec = kv_spec
        self.stores = StoreBook(kv_spec, client.block_bytes)
        self.reader = PrefixReader(
            client, self.stores, kv_spec, engine.block_manager, engine.kv_pool
        )
        self.writer = StoreWriter(
            client, self.stores, kv_spec, engine.block_manager, engine.kv_pool
        )

    def on_advert(self, advert: StoreAdvert) -> None:
        self.stores.note(advert)

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
        """Wait for the puts in flight (they hold pool blocks), then close the client."""
        await self.writer.aclose()
        await self.client.aclose()
