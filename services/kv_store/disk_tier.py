"""The kv-store's disk tier: which slot of the disk file holds which block (pure).

A disk slot is free, *busy* (a spill is writing it, or a promotion is reading it: neither
indexed nor evictable) or holds one committed block, indexed under ``(block hash, layout)`` and
in the LRU. Blocks come here only from the host tier (a host block evicted to make room is
spilled, not dropped) and leave by promotion (a get that hits them moves them back to a host
slot) or by eviction (the least recently used, dropped, when a spill needs a slot). A block is
in one tier at a time. The file and its I/O are the service's (disk_file.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

Key = tuple[int, int]  # (block hash, layout root)


@dataclass(slots=True)
class DiskSlots:
    num_slots: int
    free: list[int] = field(default_factory=list)
    index: dict[Key, int] = field(default_factory=dict)
    keys: dict[int, Key] = field(default_factory=dict)  # indexed slot -> key
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # indexed, oldest first
    num_evictions: int = 0  # blocks dropped from the disk tier to make room
    dropped: list[Key] = field(default_factory=list)  # evicted keys, until drain_dropped()

    def __post_init__(self) -> None:
        assert self.num_slots > 0, self.num_slots
        self.free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out 0, 1, ...

    def take(self) -> int | None:
        """A slot for a spill (busy until ``fill`` or ``give_back``): a free one, else the least
        recently used block's, which is dropped. None when every slot is busy."""
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        slot, _ = self.lru.popitem(last=False)
        key = self.keys.pop(slot)
        del self.index[key]
        self.dropped.append(key)
        self.num_evictions += 1
        return slot

    def drain_dropped(self) -> list[Key]:
        """The keys ``take`` dropped since the last call (the store forgets their writers)."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def fill(self, slot: int, key: Key) -> None:
        """A spill into busy ``slot`` finished: index it, most recently used."""
        assert key not in self.index and slot not in self.keys, (key, slot)
        self.index[key] = slot
        self.keys[slot] = key
        self.lru[slot] = None

    def detach(self, key: Key) -> int:
        """Take ``key``'s slot out of the index for a promotion (busy until ``give_back``)."""
        slot = self.index.pop(key)
        del self.keys[slot]
        del self.lru[slot]
        return slot

    def give_back(self, slot: int) -> None:
        """A busy slot is free again (its block promoted, or its spill abandoned)."""
        assert slot not in self.keys, slot
        self.free.append(slot)

    def touch(self, key: Key) -> None:
        self.lru.move_to_end(self.index[key])

    @property
    def num_used(self) -> int:
        return len(self.index)

    @property
    def num_busy(self) -> int:
        return self.num_slots - len(self.free) - len(self.index)
