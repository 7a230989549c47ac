"""What a kv-store holds, as numbered messages for the kv-registry's prefix index (pure).

The store reports the block hashes it holds the way a decode worker reports its prefix cache
(``services/decode/cache_reports.py``), with the same messages on subjects of its own
(``Subjects.REGISTRY_STORE_KV_EVENTS`` / ``_DIGEST``): ``KvCacheEvents`` with what entered and
left since the last report, and a ``KvCacheDigest`` (everything) first, periodically and when a
change is too large for one message. ``worker_id`` is the store's id, ``epoch`` its process.

"Holds" means findable by a get: in the host index, on the disk tier, or being copied between
them (``held_hashes``). A store has one layout, so a hash alone names a block (its chain is
rooted in the layout: ``shared/kv/prefix_hash.py``), the same hash a decode worker reports.

Unlike the decode worker, whose block manager logs each change as it happens, the store compares
what it holds with what it last told (a set difference, O(blocks held)) at each report, and only
when its counters moved since the previous report; ``BlockStore`` needs no hook at each site
that adds or drops a key.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from kvmesh.services.kv_store.core import BlockStore
from kvmesh.shared.bus.messages.cache_events import (
    MAX_CACHE_EVENT_HASHES,
    KvCacheDigest,
    KvCacheEvents,
)


def held_hashes(store: BlockStore) -> list[int]:
    """Every hash a get can find now, roughly oldest first (host index in insertion order, then
    the disk tier, then the keys in transit between them)."""
    keys = list(store.index)
    if store.disk is not None:
        keys += store.disk.index
    keys += store.transit
    return [h for h, _layout in dict.fromkeys(keys)]


def change_mark(store: BlockStore) -> tuple[int, ...]:
    """Counters that move whenever what the store holds may have changed."""
    c = store.counters
    disk = store.disk
    return (
        c.commits,
        c.evictions,
        c.quota_evictions,
        c.owner_drops,
        c.spills,
        c.promotions,
        c.failed_copies,
        store.num_used,
        len(store.transit),
        len(disk.index) if disk is not None else 0,
        disk.num_evictions if disk is not None else 0,
    )


class HeldReporter:
    def __init__(
        self, store_id: str, epoch: str | None = None, max_hashes: int = MAX_CACHE_EVENT_HASHES
    ) -> None:
        """``epoch``: the store process's (its adverts'), so the registry sees one restart."""
        assert 0 < max_hashes <= MAX_CACHE_EVENT_HASHES
        self.store_id = store_id
        self.epoch = epoch or uuid.uuid4().hex[:12]
        self.max_hashes = max_hashes
        self._seq = 0
        self._told: set[int] | None = None  # None: the registry knows nothing yet

    @property
    def needs_digest(self) -> bool:
        return self._told is None

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def events(self, held: Sequence[int]) -> KvCacheEvents | KvCacheDigest | None:
        """What changed since the last report (None: nothing); a digest instead when none was
        sent yet or the change does not fit one message."""
        if self._told is None:
            return self.digest(held)
        now = set(held)
        stored = tuple(h for h in held if h not in self._told)
        removed = tuple(self._told - now)
        if not stored and not removed:
            return None
        if len(stored) > self.max_hashes or len(removed) > self.max_hashes:
            return self.digest(held)
        self._told = now
        return KvCacheEvents(self.store_id, self.epoch, self._next_seq(), stored, removed)

    def digest(self, held: Sequence[int]) -> KvCacheDigest:
        """Everything held (the newest ``max_hashes`` when more: the registry then knows only
        those until they change)."""
        self._told = set(held)
        return KvCacheDigest(
            self.store_id,
            self.epoch,
            self._next_seq(),
            tuple(held[-self.max_hashes :]),
            num_cached_blocks=len(held),
        )
