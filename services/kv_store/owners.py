"""Who put each block the store holds, and how many each writer holds (pure).

A block is recorded under the writer that committed it (the put's ``client_id``: the worker id
its role's NATS user sent, the id the kv-registry drops it by). The store uses the record three
ways (docs/security.md, "The store trusts only what it can attribute"): a writer holds at most
its quota of the store's blocks (a new put past it recycles the writer's own least recently
used blocks first), and when the kv-registry drops a worker, every block it put is evicted.
The record moves with a block between tiers and goes when the block leaves the store.
"""

from __future__ import annotations

from collections import Counter

from kvmesh.services.kv_store.tier_slots import Key


class BlockOwners:
    def __init__(self) -> None:
        self._owner: dict[Key, str] = {}
        self._count: Counter[str] = Counter()

    def record(self, key: Key, owner: str) -> None:
        """``key`` was committed by ``owner`` (a key already recorded keeps its first owner)."""
        if key not in self._owner:
            self._owner[key] = owner
            self._count[owner] += 1

    def forget(self, key: Key) -> None:
        """``key`` left the store (dropped, rejected, or evicted with its owner)."""
        owner = self._owner.pop(key, None)
        if owner is not None:
            self._count[owner] -= 1
            if not self._count[owner]:
                del self._count[owner]

    def owner(self, key: Key) -> str | None:
        return self._owner.get(key)

    def count(self, owner: str) -> int:
        return self._count.get(owner, 0)

    def keys_of(self, owner: str) -> list[Key]:
        return [k for k, o in self._owner.items() if o == owner]

    def __len__(self) -> int:
        return len(self._owner)


def writer_quota(share: float, num_blocks: int, num_disk_slots: int) -> int:
    """Blocks one writer may hold: ``share`` of the store (host and disk), at least one; 0 (no
    limit) for a share of 1."""
    assert 0 < share <= 1, share
    if share >= 1:
        return 0
    return max(1, int(share * (num_blocks + num_disk_slots)))


__all__ = ["BlockOwners", "writer_quota"]
