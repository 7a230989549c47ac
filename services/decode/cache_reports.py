"""The decode worker's prefix cache as numbered messages for the kv-registry's prefix index.

``CacheReporter`` hangs a CacheEventLog on the engine's block manager and turns what it recorded
into KvCacheEvents (changes since the last report), or a KvCacheDigest (the whole cache) when
one is due: periodically, and at once when a batch overflowed its bound. Every message carries
the next ``seq`` of this process's ``epoch``, so a registry that missed one knows it.
Pure: the service decides when to report, and takes a digest while the engine is not stepping
(it reads the block manager's table).
"""

from __future__ import annotations

import uuid

from kvmesh.shared.bus.messages.cache_events import (
    MAX_CACHE_EVENT_HASHES,
    KvCacheDigest,
    KvCacheEvents,
)
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.cache_events import CacheEventLog


class CacheReporter:
    def __init__(self, worker_id: str, block_manager: BlockManager, max_events: int) -> None:
        assert 0 < max_events <= MAX_CACHE_EVENT_HASHES
        self.worker_id = worker_id
        self.epoch = uuid.uuid4().hex[:12]
        self._bm = block_manager
        self._log = block_manager.events = CacheEventLog(max_events)
        self._seq = 0
        self.needs_digest = True  # the registry knows nothing of a new worker

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def events(self) -> KvCacheEvents | None:
        """The changes since the last report (None: none). After an overflow this returns None
        and sets ``needs_digest``: the changes are lost, a digest replaces them."""
        batch = self._log.take()
        if batch.overflowed:
            self.needs_digest = True
            return None
        if not batch.stored and not batch.removed:
            return None
        return KvCacheEvents(
            self.worker_id, self.epoch, self._next_seq(), batch.stored, batch.removed
        )

    def digest(self) -> KvCacheDigest:
        """The whole cache now (the newest MAX_CACHE_EVENT_HASHES hashes, newest last). Call it
        while no engine step runs: the changes logged so far are in it, so they are dropped."""
        self._log.take()
        cached = list(self._bm.hash_to_block)  # insertion order: the newest last
        self.needs_digest = False
        return KvCacheDigest(
            self.worker_id,
            self.epoch,
            self._next_seq(),
            tuple(cached[-MAX_CACHE_EVENT_HASHES:]),
            num_cached_blocks=len(cached),
        )
