"""A decode worker's puts into a kv-store (docs/kv_store.md): when a request finishes, the full
blocks of its prompt and output whose KV the engine computed (all but the last sampled token's)
are put into the store in the background, pinned in the pool while the write is in flight. A
later turn of the conversation, which resends them, is then read by the prefill worker instead
of computed. Best effort: a store that is absent, full or failing costs a prefill, and a step
never waits for a put (the engine lock is held only to pin and unpin). A step hook of the decode
worker (``step_hooks.py``): after each step it puts the requests that ended with "stop" or
"length" (an aborted or failed request's output is not a conversation's next turn).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.kv_store_writer import StoreWriter
from kvmesh.shared.mesh.store_book import StoreBook

if TYPE_CHECKING:
    from kvmesh.services.decode.compose import DecodeParts


class FinishedPuts(StepHook):
    def __init__(
        self, engine: LLMEngine, client: KvStoreClient, stores: StoreBook, lock: asyncio.Lock
    ) -> None:
        """``client``, ``stores``: the worker's kv-store link's (shared/mesh/store_link.py)."""
        self.engine = engine
        self.lock = lock  # the engine's: a put pins and unpins blocks under it
        self.client = client
        self.kv_spec = stores.kv_spec
        self.stores = stores
        self.writer = StoreWriter(client, self.stores, self.kv_spec, engine)

    @classmethod
    def compose(cls, parts: DecodeParts) -> FinishedPuts | None:
        link = parts.store_link()
        return cls(parts.engine, link.client, link.stores, parts.lock) if link else None

    def after_step(self, engine: LLMEngine, step: Step) -> None:
        for out, seq in step.finished():
            if out.finish_reason in ("stop", "length"):
                self.put_later(list(seq.token_ids), seq.params.cache_salt)

    def put_later(self, token_ids: list[int], cache_salt: str = "") -> None:
        """Put the computed full blocks of a finished sequence (``token_ids``: prompt and output;
        the last token's KV was never computed), named under its ``cache_salt``."""
        if len(token_ids) >= 2:
            self.writer.put_later(token_ids[:-1], self.lock, cache_salt)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they pin pool blocks; the link closes the client)."""
        await self.writer.aclose()
