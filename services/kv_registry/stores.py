"""The KV stores the registry knows of: the latest StoreAdvert of each (pure, clock passed in).

A store is soft state as a decode worker is: its adverts carry everything (capacity, use, hit
counts), so a restarted registry knows every store again within one advert interval, and a
store silent (no advert, no heartbeat) for the worker timeout is dropped. ``kvmesh admin status`` lists them (``stores``).

What each store holds is indexed as decode workers' caches are (a ``PrefixIndex`` of its own,
fed by the store's KvCacheEvents and KvCacheDigests, held_reports.py): ``matched_blocks`` says
how many leading blocks of a prompt's chain the store that workers of a layout read holds, by
which placement decides (prefix_reach.py). A store's entries go when it is dropped or restarts
(a new epoch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.services.kv_registry.prefix_index import PrefixIndex
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.messages.admin import StoreStatusRow
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.worker_state import WorkerState


@dataclass(slots=True)
class StoreView:
    advert: StoreAdvert
    last_seen: float  # registry clock


@dataclass(slots=True)
class StoreTable:
    timeout_s: float
    stores: dict[str, StoreView] = field(default_factory=dict)
    # what each store holds (keyed by store id; as big as a decode worker's by default)
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    hearing: Hearing = field(default_factory=Hearing)  # silence counts only while connected

    def observe(self, advert: StoreAdvert, now: float) -> bool:
        """Record a store's advert; True for a store not known before (or restarted: new epoch)."""
        known = self.stores.get(advert.store_id)
        self.stores[advert.store_id] = StoreView(advert, now)
        indexed = self.prefixes.workers.get(advert.store_id)
        if indexed is not None and indexed.epoch != advert.reach.epoch:
            self.prefixes.drop_worker(advert.store_id)  # what the old process held is gone
        return known is None or known.advert.reach.epoch != advert.reach.epoch

    def heard(self, store_id: str, now: float) -> None:
        """The store's heartbeat: alive, though its adverts may lag (they come from its event
        loop, its heartbeats from a thread of their own: shared/bus/liveness.py), so a store
        busy for a while is not dropped while it still beats."""
        view = self.stores.get(store_id)
        if view is not None:
            view.last_seen = max(view.last_seen, now)

    def observe_events(self, msg: KvCacheEvents) -> bool:
        """A store's changes; False (ignored) for a store not known by its adverts (it resyncs
        with its next digest once it is)."""
        return self.prefixes.apply_from(self.stores, msg)

    def observe_digest(self, msg: KvCacheDigest) -> bool:
        """Everything a store holds; False (ignored) for an unknown store."""
        return self.prefixes.apply_from(self.stores, msg)

    def matched_blocks(self, kv_spec: str, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` (a prompt's hashes in layout ``kv_spec``) the
        store a worker of that layout reads holds (``reader_store``)."""
        store_id = self.reader_store(kv_spec)
        return 0 if store_id is None else self.prefixes.matched_blocks(store_id, chain)

    def reader_store(self, kv_spec: str) -> str | None:
        """The store a worker of layout ``kv_spec`` reads: the ready one with the lowest id, as
        the workers' ``StoreBook.target`` picks it (shared/mesh/store_book.py), so that placement
        counts the blocks of the store the worker will ask, not those of another."""
        ready = [
            sid
            for sid, v in self.stores.items()
            if v.advert.reach.kv_spec == kv_spec and v.advert.load.state == WorkerState.READY
        ]
        return min(ready, default=None)

    def expire(self, now: float) -> list[str]:
        """Drop stores silent for longer than ``timeout_s``; returns their ids."""
        dead = [
            sid
            for sid, v in self.stores.items()
            if self.hearing.silence(v.last_seen, now) > self.timeout_s
        ]
        for sid in dead:
            del self.stores[sid]
            self.prefixes.drop_worker(sid)
        return dead

    def status(self, now: float) -> tuple[StoreStatusRow, ...]:
        rows = []
        for v in sorted(self.stores.values(), key=lambda v: v.advert.store_id):
            load, block_bytes = v.advert.load, v.advert.reach.block_bytes
            asked = load.hits + load.misses
            rows.append(
                StoreStatusRow(
                    store_id=v.advert.store_id,
                    load=load,
                    reach=v.advert.reach,
                    capacity_bytes=load.total_blocks * block_bytes,
                    used_bytes=load.used_blocks * block_bytes,
                    disk_capacity_bytes=load.disk_total_blocks * block_bytes,
                    disk_used_bytes=load.disk_used_blocks * block_bytes,
                    hit_rate=round(load.hits / asked, 4) if asked else 0.0,
                    indexed_blocks=self.prefixes.num_blocks(v.advert.store_id),
                    index_synced=self.prefixes.is_synced(v.advert.store_id),
                    last_seen_s=round(now - v.last_seen, 3),
                )
            )
        return tuple(rows)
