"""The KV store's slots: index, pins, LRU, puts and gets in flight (pure, clock passed in).

A slot is free, reserved by one put (pinned until its commit or lease end), or committed: in the
index under ``(block hash, layout)``. A committed slot is pinned while gets hold it and sits in
the LRU otherwise; a put takes free slots first, then evicts the least recently used. Every
verdict is explicit (grants.py): the service (service.py) opens and closes the windows these
slots need.

With a disk tier (``disk``, disk_tier.py) an evicted host block is *spilled* instead of dropped:
the verdict names the copies (``Spill``) the service must make before it hands the host slot
out, and a get that hits disk blocks takes host slots for them (``Promotion``: read back before
the reply). While a copy is in flight its key is *in transit*: in neither index, not served,
not written again. A key is in at most one of the host index, the disk index and transit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.services.kv_store.disk_tier import DiskSlots
from kvmesh.services.kv_store.grants import (
    GetGrant,
    HeldGet,
    HeldPut,
    Promotion,
    PutGrant,
    Spill,
    StoreFull,
)
from kvmesh.services.kv_store.owners import BlockOwners
from kvmesh.services.kv_store.store_counters import StoreCounters
from kvmesh.services.kv_store.tier_slots import Key, TierSlots


@dataclass(slots=True)
class BlockStore(TierSlots):
    """The host tier; its LRU holds the committed slots no get pins."""

    num_blocks: int
    pins: dict[int, int] = field(default_factory=dict)  # committed slot -> gets holding it
    puts: dict[str, HeldPut] = field(default_factory=dict)
    gets: dict[str, HeldGet] = field(default_factory=dict)
    counters: StoreCounters = field(default_factory=StoreCounters)
    disk: DiskSlots | None = None  # the disk tier, if any
    transit: set[Key] = field(default_factory=set)  # keys being spilled or promoted
    max_per_owner: int = 0  # blocks one writer may hold (host, disk, reserved); 0: no limit
    owners: BlockOwners = field(default_factory=BlockOwners)

    def __post_init__(self) -> None:
        self._free_all(self.num_blocks)

    # --- puts ------------------------------------------------------------------------------------

    def reserve(
        self, put_id: str, layout: int, hashes: Sequence[int], expires_at: float, owner: str = ""
    ) -> PutGrant | StoreFull:
        """Slots for the hashes not stored yet (in order, as long as slots can be had). A
        writer at its quota (``max_per_owner``) gets slots only by giving up its own least
        recently used blocks; where it has none to give, the put ends there."""
        assert put_id not in self.puts, put_id
        present, wanted = [], []
        for h in dict.fromkeys(hashes):  # a hash offered twice is written once
            (present if self._known((h, layout)) else wanted).append(h)
        slots: list[int] = []
        spills: list[Spill] = []
        held = self.owners.count(owner) + sum(
            len(p.slots) for p in self.puts.values() if p.owner == owner
        )
        full = False  # no slot for reasons other than the writer's quota
        for _ in wanted:
            at_quota = bool(self.max_per_owner) and held >= self.max_per_owner
            if at_quota and not self._give_up_oldest(owner):
                full = not self.free and not self.lru
                break
            slot = self._take_slot(spills)
            if slot is None:
                full = True
                break
            held += not at_quota
            slots.append(slot)
        if wanted and not slots and full:
            self.counters.refused_puts += 1
            return StoreFull(self.num_pinned, self.num_blocks)
        write = tuple(wanted[: len(slots)])
        for h in present:
            self._touch((h, layout))
        if slots:
            self.puts[put_id] = HeldPut(layout, write, tuple(slots), expires_at, owner)
        return PutGrant(put_id, tuple(present), write, tuple(slots), tuple(spills))

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
            elif self._known(key):  # another put committed it first: keep that copy
                self.free.append(slot)
                committed.append(h)
            else:
                self._index(slot, key)
                self.owners.record(key, put.owner)
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
        block before it). Disk blocks of the run get host slots (``promotions``), as long as
        host slots can be had; the run ends at the first that gets none."""
        assert get_id not in self.gets, get_id
        run: list[tuple[int, int | None]] = []  # (hash, host slot; None: on disk)
        for h in hashes:
            key = (h, layout)
            slot = self.index.get(key)
            if slot is not None:
                run.append((h, slot))
            elif self.disk is not None and key in self.disk.index:
                run.append((h, None))
            else:
                break
        # pin the host hits and take the disk hits out of their LRU before any slot is taken,
        # so that making room for one block of the run never evicts another
        detached: dict[int, int] = {}  # hash -> disk slot
        for h, slot in run:
            if slot is not None:
                self._pin(slot)
            else:
                assert self.disk is not None
                detached[h] = self.disk.detach((h, layout))
                self.transit.add((h, layout))
        slots: list[int] = []
        spills: list[Spill] = []
        promotions: list[Promotion] = []
        for i, (h, slot) in enumerate(run):
            if slot is None:
                slot = self._take_slot(spills)
                if slot is None:  # no host room: the run ends here
                    self._undo_lookup(run[i:], detached, layout)
                    run = run[:i]
                    break
                self.pins[slot] = 1
                promotions.append(Promotion((h, layout), detached[h], slot))
            slots.append(slot)
        self.counters.hits += len(run)
        self.counters.disk_hits += len(promotions)
        self.counters.misses += len(hashes) - len(run)
        if slots:
            self.gets[get_id] = HeldGet(tuple(slots), expires_at)
        return GetGrant(
            get_id, tuple(h for h, _ in run), tuple(slots), tuple(spills), tuple(promotions)
        )

    def _undo_lookup(
        self, rest: list[tuple[int, int | None]], detached: dict[int, int], layout: int
    ) -> None:
        """The part of a run that found no host room: host hits unpinned, disk hits back."""
        for h, slot in rest:
            if slot is not None:
                self._unpin(slot)
            else:
                assert self.disk is not None
                self.transit.discard((h, layout))
                self.disk.fill(detached[h], (h, layout))

    # --- copies between tiers (the service reports each when its I/O is done) --------------------

    def spilled(self, spill: Spill, ok: bool) -> None:
        """The copy of a spilled host block to its disk slot finished (``ok``) or failed."""
        assert self.disk is not None
        self.transit.discard(spill.key)
        if ok:
            self.disk.fill(spill.disk_slot, spill.key)
            self.counters.spills += 1
        else:
            self.disk.give_back(spill.disk_slot)
            self.owners.forget(spill.key)
            self.counters.failed_copies += 1

    def promoted(self, get_id: str, promotion: Promotion, ok: bool) -> bool:
        """The copy of a disk block back to its host slot finished (``ok``) or failed: the disk
        slot is free; the block is indexed in the host slot if the get still holds it. Returns
        whether it is (False: the caller must not serve it)."""
        assert self.disk is not None
        self.transit.discard(promotion.key)
        self.disk.give_back(promotion.disk_slot)
        if not ok:
            self.owners.forget(promotion.key)
            self.counters.failed_copies += 1
            return False
        self.counters.promotions += 1
        if get_id not in self.gets:  # its lease ended meanwhile: its slot went back free
            self.owners.forget(promotion.key)
            return False
        self.index[promotion.key] = promotion.host_slot
        self.keys[promotion.host_slot] = promotion.key
        return True

    def release(self, get_id: str) -> bool:
        """The reader is done: unpin (most recently used first to go back). False if unknown."""
        get = self.gets.pop(get_id, None)
        if get is None:
            return False
        for slot in get.slots:
            self._unpin(slot)
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

    def _known(self, key: Key) -> bool:
        """Stored in a tier, or on its way between them."""
        in_disk = self.disk is not None and key in self.disk.index
        return key in self.index or in_disk or key in self.transit

    def _take_slot(self, spills: list[Spill]) -> int | None:
        """A host slot: a free one, else the least recently used block's, which is spilled to
        disk (appended to ``spills``) when there is a disk slot for it, else dropped."""
        taken = self._take_or_evict()
        if taken is None:
            return None
        slot, key = taken
        if key is None:
            return slot
        self.counters.evictions += 1
        disk_slot = self.disk.take() if self.disk is not None else None
        if self.disk is not None:
            for dropped in self.disk.drain_dropped():
                self.owners.forget(dropped)
        if disk_slot is not None:
            self.transit.add(key)
            spills.append(Spill(key, slot, disk_slot))
        else:
            self.owners.forget(key)
        return slot

    # --- writers ---------------------------------------------------------------------------------

    def _give_up_oldest(self, owner: str) -> bool:
        """Drop ``owner``'s least recently used unpinned block to make room within its quota:
        disk first (a block reaches disk only by being the host tier's least recently used, so
        the writer's disk blocks are older than its host blocks), then host; False if it has
        none. Before (issue 43), host came first: a writer at its quota lost its newest blocks
        and kept its stale ones on disk."""
        key = None
        if self.disk is not None:
            disk_keys = (self.disk.keys[slot] for slot in self.disk.lru)
            key = next((k for k in disk_keys if self.owners.owner(k) == owner), None)
        if key is not None:
            assert self.disk is not None
            self.disk.give_back(self.disk.detach(key))
        else:
            slot = next((s for s in self.lru if self.owners.owner(self.keys[s]) == owner), None)
            if slot is None:
                return False
            key = self.keys[slot]
            del self.lru[slot], self.keys[slot], self.index[key]
            self.free.append(slot)
        self.owners.forget(key)
        self.counters.quota_evictions += 1
        return True

    def drop_owner(self, owner: str) -> list[str]:
        """Evict every block ``owner`` put (the kv-registry dropped that worker) and cancel its
        puts in flight; returns their ids (the service closes their windows). A block a get
        still holds leaves the index now and its slot when the get ends; one being copied
        between tiers goes when its copy ends."""
        for key in self.owners.keys_of(owner):
            if key in self.transit:
                continue
            slot = self.index.pop(key, None)
            if slot is not None:
                del self.keys[slot]
                if slot not in self.pins:
                    del self.lru[slot]
                    self.free.append(slot)
            elif self.disk is not None and key in self.disk.index:
                self.disk.give_back(self.disk.detach(key))
            self.owners.forget(key)
            self.counters.owner_drops += 1
        puts = [pid for pid, p in self.puts.items() if p.owner == owner]
        for pid in puts:
            self.cancel_put(pid)
        return puts

    def _pin(self, slot: int) -> None:
        self.pins[slot] = self.pins.get(slot, 0) + 1
        self.lru.pop(slot, None)

    def _unpin(self, slot: int) -> None:
        """One holder less; an unheld slot goes back to the LRU (most recently used), or to
        the free list if it was never indexed (a promotion that did not finish)."""
        self.pins[slot] -= 1
        if not self.pins[slot]:
            del self.pins[slot]
            if slot in self.keys:
                self.lru[slot] = None
            else:
                self.free.append(slot)

    def _touch(self, key: Key) -> None:
        slot = self.index.get(key)
        if slot is not None and slot in self.lru:
            self.lru.move_to_end(slot)
        elif self.disk is not None and key in self.disk.index:
            self.disk.touch(key)
