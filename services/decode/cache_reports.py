"""The decode worker's prefix cache as numbered messages for the kv-registry's prefix index.

``CacheReporter`` hangs a CacheEventLog on the engine's block manager and turns what it recorded
into KvCacheEvents (changes since the last report), or a KvCacheDigest (the whole cache) when
one is due: periodically, and at once when a batch overflowed its bound. Every message carries
the next ``seq`` of this process's ``epoch``, so a registry that missed one knows it.
``CacheReporter`` is pure; ``CacheReports``, a feature of the decode worker
(shared/bus/worker_feature.py), is its loop: it sends the changes every
``cache_events_interval_s`` on ``REGISTRY_KV_EVENTS`` and a digest every
``cache_digest_interval_s`` (and at once after an overflow) on ``REGISTRY_KV_DIGEST``, taken
under the engine lock (it reads the block manager's table while no step runs).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING

import nats.errors
from kvmesh.shared.bus.messages.cache_events import (
    MAX_CACHE_EVENT_HASHES,
    KvCacheDigest,
    KvCacheEvents,
)
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.worker_feature import Feature, Loop, Site
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.cache_events import CacheEventLog
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.decode.compose import DecodeParts

log = logs.get_logger(__name__)


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


class CacheReports(Feature):
    """Tells the kv-registry what the prefix cache holds (module docstring)."""

    def __init__(
        self,
        reporter: CacheReporter,
        lock: asyncio.Lock,
        events_interval_s: float,
        digest_interval_s: float,
    ) -> None:
        """``lock``: the engine's (a digest is taken while no step runs)."""
        self.reporter = reporter
        self.lock = lock
        self.events_interval_s = events_interval_s
        self.digest_interval_s = digest_interval_s

    @classmethod
    def compose(cls, parts: DecodeParts) -> CacheReports | None:
        """With prefix caching: the registry places requests where their prefix is cached."""
        engine, config = parts.engine, parts.config
        if not engine.config.enable_prefix_caching:
            return None
        return cls(
            CacheReporter(parts.worker_id, engine.block_manager, config.max_cache_events),
            parts.lock,
            config.cache_events_interval_s,
            config.cache_digest_interval_s,
        )

    def loops(self, site: Site) -> Sequence[Loop]:
        return (lambda: self.report_loop(site),)

    async def report_loop(self, site: Site) -> None:
        """The changes, then a digest when one is due, then a pause. One task sends both, so
        they go out in ``seq`` order."""
        reporter, subjects = self.reporter, site.subjects
        next_digest = 0.0
        while True:
            events = reporter.events()  # no lock: the log has its own
            if events is not None:
                await _send(site, subjects.REGISTRY_KV_EVENTS, events)
            if reporter.needs_digest or time.monotonic() >= next_digest:
                async with self.lock:  # it reads the table
                    digest = reporter.digest()
                await _send(site, subjects.REGISTRY_KV_DIGEST, digest)
                next_digest = time.monotonic() + self.digest_interval_s
            await asyncio.sleep(self.events_interval_s)


async def _send(site: Site, subject: str, msg: KvCacheEvents | KvCacheDigest) -> None:
    try:
        await site.nc.publish(subject, encode_message(msg))
    except nats.errors.Error as exc:  # the registry notices the gap and waits for a digest
        log.debug("cache report not sent", subject=subject, error=str(exc))
