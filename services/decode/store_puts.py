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

from kvmesh.services.decode.step_hooks import Step, StepHook
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import (
    KvStoreClient,
    StoreBook,
    StoreTarget,
    put_cached_prefix,
)
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)


class FinishedPuts(StepHook):
    def __init__(
        self, engine: LLMEngine, client: KvStoreClient, kv_spec: str, lock: asyncio.Lock
    ) -> None:
        self.engine = engine
        self.lock = lock  # the engine's: a put pins and unpins blocks under it
        self.client = client
        self.kv_spec = kv_spec
        self.stores = StoreBook(kv_spec, client.block_bytes)
        self._puts: set[asyncio.Task[None]] = set()
        self.num_puts = 0  # puts that ended, and the blocks they committed
        self.num_blocks_committed = 0

    def on_advert(self, advert: StoreAdvert) -> None:
        self.stores.note(advert)

    def after_step(self, engine: LLMEngine, step: Step) -> None:
        for out, seq in step.finished():
            if out.finish_reason in ("stop", "length"):
                self.put_later(list(seq.token_ids), seq.params.cache_salt)

    def put_later(self, token_ids: list[int], cache_salt: str = "") -> None:
        """Put the computed full blocks of a finished sequence (``token_ids``: prompt and output;
        the last token's KV was never computed), named under its ``cache_salt``."""
        store = self.stores.target()
        if store is None or len(token_ids) < 2:
            return
        task = asyncio.ensure_future(self._put(store, token_ids[:-1], cache_salt))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _put(self, store: StoreTarget, token_ids: list[int], cache_salt: str) -> None:
        pool, bm = self.engine.kv_pool, self.engine.block_manager
        try:
            result = await put_cached_prefix(
                self.client, store, self.kv_spec, bm, pool, token_ids, self.lock, cache_salt
            )
        except Exception as exc:  # best effort: the store misses these blocks
            log.warning("kv-store put failed", error=str(exc))
            self.stores.forget(store.store_id)
            return
        if result is None:
            return
        self.num_puts += 1
        self.num_blocks_committed += len(result.committed)
        if not result.ok:
            log.info("kv-store put refused", error=result.error)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they pin pool blocks), then close the client."""
        if self._puts:
            await asyncio.gather(*self._puts, return_exceptions=True)
        await self.client.aclose()
