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

from kvmesh.services.prefill.job_hooks import JobHook
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.kv_store_prefix import Fetched, PoolIo, PrefixReader
from kvmesh.shared.mesh.kv_store_writer import StoreWriter
from kvmesh.shared.mesh.store_book import StoreBook

if TYPE_CHECKING:
    from kvmesh.services.prefill.compose import PrefillParts
    from kvmesh.services.prefill.job import Job
    from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob


class StorePrefix(JobHook):
    """A job hook (job_hooks.py): ``prepare`` reads, ``before_add`` adopts, ``finish`` puts."""

    def __init__(
        self,
        engine: LLMEngine,
        client: KvStoreClient,
        stores: StoreBook,
        lock: asyncio.Lock,
        metrics: PrefillMetrics,
    ) -> None:
        """``client``, ``stores``: the worker's kv-store link's (shared/mesh/store_link.py);
        ``lock``: the engine lock."""
        self.engine = engine
        self.client = client
        self.kv_spec = kv_spec = stores.kv_spec
        self.stores = stores
        self.lock = lock
        self.metrics = metrics
        self.reader = PrefixReader(PoolIo.of(client, kv_spec, engine), self.stores)
        self.writer = StoreWriter(client, self.stores, kv_spec, engine)
        self._fetched: dict[str, Fetched] = {}  # by request id, from prepare to before_add

    @classmethod
    def compose(cls, parts: PrefillParts) -> StorePrefix | None:
        link = parts.store_link()
        if link is None:
            return None
        return cls(parts.engine, link.client, link.stores, parts.lock, parts.metrics)

    async def prepare(self, job: Job) -> None:
        """Read the prompt's prefix blocks (named under the request's ``cache_salt``) the prefix
        cache lacks from the store into fresh pool blocks (allocated under the lock, read
        without it)."""
        msg = job.msg
        fetched = await self.reader.fetch(list(msg.prompt_ids), self.lock, msg.sampling.cache_salt)
        if fetched is not None:
            self._fetched[msg.request_id] = fetched

    def before_add(self, job: Job) -> None:
        """Under the engine lock, right before the prompt is added: the verified blocks enter the
        prefix cache, every fetched block is freed."""
        fetched = self._fetched.pop(job.msg.request_id, None)
        if fetched is not None:
            self.metrics.store_hit_tokens.inc(self.reader.adopt(fetched))

    def finish(self, msg: PrefillJob, job: Job | None, ok: bool, error: str) -> None:
        """A computed prompt's full blocks (still cached) go into the store in the background."""
        if job is not None and job.is_computed and not error:
            self.writer.put_later(list(msg.prompt_ids), self.lock, msg.sampling.cache_salt)

    async def aclose(self) -> None:
        """Wait for the puts in flight (they hold pool blocks; the link closes the client)."""
        await self.writer.aclose()
