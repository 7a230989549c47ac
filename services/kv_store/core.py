"""The KV store's slots: index, pins, LRU, puts and gets in flight (pure, clock passed in).

A slot is free, reserved by one put (pinned until its commit or lease end), or committed: in the
index under ``(block hash, layout)``. A committed slot is pinned while gets hold it and sits in
the LRU otherwise; a put takes free slots first, then evicts the least recently used. Every
verdict is explicit: the service (service.py) opens and closes the windows these slots need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PutGrant:
    """``present``: hashes already stored; ``slots[i]`` is where ``write_hashes[i]`` goes.
    Hashes in neither found no room."""

    put_id: str
    present: tuple[int, ...]
    write_hashes: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StoreFull:
    """No slot for any missing hash: every slot is pinned by puts or gets in flight."""

    num_pinned: int
    num_blocks: int

    @property
    def error(self) -> str:
        return (
            f"the store is full of pinned blocks ({self.num_pinned} of {self.num_blocks} held "
            "by puts and gets in flight, none evictable); retry later"
        )


@dataclass(frozen=True, slots=True)
class GetGrant:
    """The leading run of the asked hashes that the store holds, pinned, and their slots."""

    get_id: str
    block_hashes: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(slots=True)
class _Put:
    layout: int
    hashes: tuple[int, ...]
    slots: tuple[int, ...]
    expires_at: float


@dataclass(slots=True)
class _Get:
    slots: tuple[int, ...]
    expires_at: float


@dataclass(slots=True)
class StoreCounters:
    hits: int = 0  # blocks served by gets
    misses: int = 0  # blocks asked for and not served
    commits: int = 0  # blocks indexed
    rejected: int = 0  # blocks a commit refused (bad header or bytes)
    evictions: int = 0
    refused_puts: int = 0  # puts refused because every slot was pinned
    expired_puts: int = 0
    expired_gets: int = 0


@dataclass(slots=True)
class BlockStore:
    num_blocks: int
    free: list[int] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (hash, layout) -> slot
    keys: dict[int, tuple[int, int]] = field(default_factory=dict)  # committed slot -> key
    pins: dict[int, int] = field(default_factory=dict)  # committed slot -> gets holding it
    lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # unpinned, oldest first
    puts: dict[str, _Put] = field(default_factory=dict)
    gets: dict[str, _Get] = field(default_factory=dict)
    counters: StoreCounters = field(default_factory=StoreCounters)

    def __post_init__(self) -> None:
        assert self.num_blocks > 0, self.num_blocks
        self.free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ...

    # --- puts ------------------------------------------------------------------------------------

    def reserve(
        self, put_id: str, layout: int, hashes: Sequence[int], expires_at: float
    ) -> PutGrant | StoreFull:
        """Slots for the hashes not stored yet (in order, as long as slots can be had)."""
        assert put_id not in self.puts, put_id
        present, wanted = [], []
        for h in dict.fromkeys(hashes):  # a hash offered twice is written once
            (present if (h, layout) in self.index else wanted).append(h)
        slots: list[int] = []
        for _ in wanted:
            slot = self._take_slot()
            if slot is None:
                break
            slots.append(slot)
        if wanted and not slots:
            self.counters.refused_puts += 1
            return StoreFull(self.num_pinned, self.num_blocks)
        write = tuple(wanted[: len(slots)])
        for h in present:
            self._touch(self.index[(h, layout)])
        if slots:
            self.puts[put_id] = _Put(layout, write, tuple(slots), expires_at)
        return PutGrant(put_id, tuple(present), write, tuple(slots))

    def commit(self, put_id: str, good: Sequence[bool]) -> tuple[list[int], list[int]]:
        """Index the put's slots whose check passed (``good[i]`` for ``slots[i]``), free the
        rest. Returns (committed hashes, rejected hashes); unknown put: ([], [])."""
        put = self.puts.pop(put_id, None)
        if put is None:
            return [], []
        assert len(good) == len(put.slots), (len(good), len(put.slots))
        committed, rejected = [], []
        for h, slot, ok in zip(put.hashes, put.slots, good, strict=True):
            key = (h, put.layout)
            if not ok:
                rejected.append(h)
                self.free.append(slot)
                self.counters.rejected += 1
            elif key in self.index:  # another put committed it first: keep that copy
                self.free.append(slot)
                committed.append(h)
            else:
                self.index[key] = slot
                self.keys[slot] = key
                self.lru[slot] = None
                committed.append(h)
                self.counters.commits += 1
        return committed, rejected

    def cancel_put(self, put_id: str) -> None:
        """Give a put's slots back unwritten (its window could not be opened)."""
        put = self.puts.pop(put_id, None)
        if put is not None:
            self.free.extend(put.slots)

    def put_slots(self, put_id: str) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """(hashes, slots, layout) of a put in flight, or None."""
        put = self.puts.get(put_id)
        return (put.hashes, put.slots, put.layout) if put else None

    # --- gets ------------------------------------------------------------------------------------

    def lookup(
        self, get_id: str, layout: int, hashes: Sequence[int], expires_at: float
    ) -> GetGrant:
        """Pin the leading run of ``hashes`` that is stored (a block is of use only with every
        block before it)."""
        assert get_id not in self.gets, get_id
        run: list[int] = []
        slots: list[int] = []
        for h in hashes:
            slot = self.index.get((h, layout))
            if slot is None:
                break
            run.append(h)
            slots.append(slot)
        self.counters.hits += len(run)
        self.counters.misses += len(hashes) - len(run)
        for slot in slots:
            self.pins[slot] = self.pins.get(slot, 0) + 1
            self.lru.pop(slot, None)
        if slots:
            self.gets[get_id] = _Get(tuple(slots), expires_at)
        return GetGrant(get_id, tuple(run), tuple(slots))

    def release(self, get_id: str) -> bool:
        """The reader is done: unpin (most recently used first to go back). False if unknown."""
        get = self.gets.pop(get_id, None)
        if get is None:
            return False
        for slot in get.slots:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                del self.pins[slot]
                self.lru[slot] = None
        return True

    # --- time ------------------------------------------------------------------------------------

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Puts and gets whose lease ended: puts' slots freed, gets released. Returns their ids
        (the service closes their windows)."""
        puts = [pid for pid, p in self.puts.items() if p.expires_at <= now]
        for pid in puts:
            self.free.extend(self.puts.pop(pid).slots)
            self.counters.expired_puts += 1
        gets = [gid for gid, g in self.gets.items() if g.expires_at <= now]
        for gid in gets:
            self.release(gid)
            self.counters.expired_gets += 1
        return puts, gets

    # --- views -----------------------------------------------------------------------------------

    @property
    def num_used(self) -> int:
        return len(self.index)

    @property
    def num_pinned(self) -> int:
        return len(self.pins) + sum(len(p.slots) for p in self.puts.values())

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take_slot(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        slot, _ = self.lru.popitem(last=False)
        del self.index[self.keys.pop(slot)]
        self.counters.evictions += 1
        return slot

    def _touch(self, slot: int) -> None:
        if slot in self.lru:
            self.lru.move_to_end(slot)
