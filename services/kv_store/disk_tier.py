"""The kv-store's disk tier: which slot of the disk file holds which block (pure).

A disk slot is free, *busy* (a spill is writing it, or a promotion is reading it: neither
indexed nor evictable) or holds one committed block, indexed under ``(block hash, layout)`` and
in the LRU. Blocks come here only from the host tier (a host block evicted to make room is
spilled, not dropped) and leave by promotion (a get that hits them moves them back to a host
slot) or by eviction (the least recently used, dropped, when a spill needs a slot). A block is
in one tier at a time. The file and its I/O are the service's (disk_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.services.kv_store.tier_slots import Key, TierSlots


@dataclass(slots=True)
class DiskSlots(TierSlots):
    num_slots: int
    num_evictions: int = 0  # blocks dropped from the disk tier to make room
    dropped: list[Key] = field(default_factory=list)  # evicted keys, until drain_dropped()

    def __post_init__(self) -> None:
        self._free_all(self.num_slots)

    def take(self) -> int | None:
        """A slot for a spill (busy until ``fill`` or ``give_back``): a free one, else the least
        recently used block's, which is dropped. None when every slot is busy."""
        taken = self._take_or_evict()
        if taken is None:
            return None
        slot, key = taken
        if key is not None:
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
        self._index(slot, key)

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
