"""The slots of one kv-store tier (pure): what the host tier (core.py) and the disk tier
(disk_tier.py) keep alike.

A slot is free, or holds one block indexed under ``(block hash, layout)`` and, while it may be
evicted, in the LRU; each tier adds its own states (pinned, busy). Slots are handed out free
first, then by evicting the least recently used block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

Key = tuple[int, int]  # (block hash, layout root)


@dataclass(slots=True)
class TierSlots:
    free: list[int] = field(default_factory=list, kw_only=True)
    index: dict[Key, int] = field(default_factory=dict, kw_only=True)  # key -> slot
    keys: dict[int, Key] = field(default_factory=dict, kw_only=True)  # indexed slot -> key
    # indexed and evictable, oldest first
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict, kw_only=True)

    def _free_all(self, num_slots: int) -> None:
        assert num_slots > 0, num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, ...

    def _take_or_evict(self) -> tuple[int, Key | None] | None:
        """A free slot (key None), else the least recently used block's, taken out of the index
        (with its key). None when there is neither."""
        if self.free:
            return self.free.pop(), None
        if not self.lru:
            return None
        slot, _ = self.lru.popitem(last=False)
        key = self.keys.pop(slot)
        del self.index[key]
        return slot, key

    def _index(self, slot: int, key: Key) -> None:
        """``slot`` holds ``key``'s block now: indexed, most recently used."""
        self.index[key] = slot
        self.keys[slot] = key
        self.lru[slot] = None
