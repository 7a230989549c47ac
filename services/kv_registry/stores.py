"""The KV stores the registry knows of: the latest StoreAdvert of each (pure, clock passed in).

A store is soft state as a decode worker is: its adverts carry everything (capacity, use, hit
counts), so a restarted registry knows every store again within one advert interval, and a
store silent for the worker timeout is dropped. ``kvmesh admin status`` lists them (``stores``).
Placement does not use them yet (docs/kv_store.md, "Not done").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.shared.protocol import StoreAdvert


@dataclass(slots=True)
class StoreView:
    advert: StoreAdvert
    last_seen: float  # registry clock


@dataclass(slots=True)
class StoreTable:
    timeout_s: float
    stores: dict[str, StoreView] = field(default_factory=dict)

    def observe(self, advert: StoreAdvert, now: float) -> bool:
        """Record a store's advert; True for a store not known before (or restarted: new epoch)."""
        known = self.stores.get(advert.store_id)
        self.stores[advert.store_id] = StoreView(advert, now)
        return known is None or known.advert.epoch != advert.epoch

    def expire(self, now: float) -> list[str]:
        """Drop stores silent for longer than ``timeout_s``; returns their ids."""
        dead = [sid for sid, v in self.stores.items() if now - v.last_seen > self.timeout_s]
        for sid in dead:
            del self.stores[sid]
        return dead

    def status(self, now: float) -> list[dict]:
        rows = []
        for v in sorted(self.stores.values(), key=lambda v: v.advert.store_id):
            a = v.advert
            asked = a.hits + a.misses
            rows.append(
                {
                    "store_id": a.store_id,
                    "state": a.state,
                    "total_blocks": a.total_blocks,
                    "used_blocks": a.used_blocks,
                    "pinned_blocks": a.pinned_blocks,
                    "capacity_bytes": a.total_blocks * a.block_bytes,
                    "used_bytes": a.used_blocks * a.block_bytes,
                    "hits": a.hits,
                    "misses": a.misses,
                    "hit_rate": round(a.hits / asked, 4) if asked else 0.0,
                    "evictions": a.evictions,
                    "disk_total_blocks": a.disk_total_blocks,
                    "disk_used_blocks": a.disk_used_blocks,
                    "disk_capacity_bytes": a.disk_total_blocks * a.block_bytes,
                    "disk_used_bytes": a.disk_used_blocks * a.block_bytes,
                    "disk_hits": a.disk_hits,
                    "disk_evictions": a.disk_evictions,
                    "bytes_written": a.bytes_written,
                    "bytes_read": a.bytes_read,
                    "refused_accesses": a.refused_accesses,
                    "kv_spec": a.kv_spec,
                    "epoch": a.epoch,
                    "last_seen_s": round(now - v.last_seen, 3),
                }
            )
        return rows
