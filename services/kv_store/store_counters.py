"""What a kv-store counts (``BlockStore.counters``): metrics.py exports them, the store's advert
carries some, and held_reports.py watches them for changes to what the store holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StoreCounters:
    hits: int = 0  # blocks served by gets (either tier)
    misses: int = 0  # blocks asked for and not served
    commits: int = 0  # blocks indexed
    rejected: int = 0  # blocks a commit refused (bad header or bytes)
    evictions: int = 0  # blocks evicted from the host tier (spilled or dropped)
    disk_hits: int = 0  # of ``hits``, blocks found on disk (promoted)
    spills: int = 0  # host blocks copied to disk
    promotions: int = 0  # disk blocks copied back to host
    failed_copies: int = 0  # spills and promotions whose I/O failed (the block is dropped)
    refused_puts: int = 0  # puts refused because every slot was pinned
    quota_evictions: int = 0  # a writer's own blocks recycled for its puts past its quota
    owner_drops: int = 0  # blocks evicted because the kv-registry dropped their writer
    expired_puts: int = 0
    expired_gets: int = 0
