"""What the kv-store's slots answer a put or a get (``BlockStore.reserve``, ``lookup``), and
what they hold for each until it ends (pure).

A grant names the slots the caller may write (a put) or read (a get) and the copies between
tiers the service must make before it replies (``Spill``: a host block evicted to disk to free
its slot; ``Promotion``: a disk block read back into a host slot). A put finds no room at all
only when every slot is pinned (``StoreFull``). Until its commit, release or lease end, each
grant is held (``HeldPut``, ``HeldGet``): its slots stay pinned.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.services.kv_store.tier_slots import Key


@dataclass(frozen=True, slots=True)
class Spill:
    """Copy host slot ``host_slot`` (block and header) to disk slot ``disk_slot``, then report
    ``spilled``; the host slot's new holder may write it only after the copy."""

    key: Key
    host_slot: int
    disk_slot: int


@dataclass(frozen=True, slots=True)
class Promotion:
    """Copy disk slot ``disk_slot`` to host slot ``host_slot`` (after the op's spills), then
    report ``promoted``; the reader may read the host slot only after the copy."""

    key: Key
    disk_slot: int
    host_slot: int


@dataclass(frozen=True, slots=True)
class PutGrant:
    """``present``: hashes already stored; ``slots[i]`` is where ``write_hashes[i]`` goes.
    Hashes in neither found no room. ``spills``: copies to make before the reply."""

    put_id: str
    present: tuple[int, ...]
    write_hashes: tuple[int, ...]
    slots: tuple[int, ...]
    spills: tuple[Spill, ...] = ()


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
    """The leading run of the asked hashes that the store holds, pinned, and their host slots;
    ``spills`` then ``promotions``: copies to make before the reply (disk hits)."""

    get_id: str
    block_hashes: tuple[int, ...]
    slots: tuple[int, ...]
    spills: tuple[Spill, ...] = ()
    promotions: tuple[Promotion, ...] = ()


@dataclass(slots=True)
class HeldPut:
    layout: int
    hashes: tuple[int, ...]
    slots: tuple[int, ...]
    expires_at: float
    owner: str = ""


@dataclass(slots=True)
class HeldGet:
    slots: tuple[int, ...]
    expires_at: float
