"""The kv-store attributes every block to the writer that put it (issue #27, item 6): a writer
holds at most its quota, and the blocks of a worker the kv-registry dropped are evicted
(services/kv_store/owners.py, core.py)."""

from __future__ import annotations

from kvmesh.services.kv_store.core import BlockStore
from kvmesh.services.kv_store.disk_tier import DiskSlots
from kvmesh.services.kv_store.grants import PutGrant, StoreFull
from kvmesh.services.kv_store.owners import BlockOwners, writer_quota

L = 7  # a layout root


def stored(store: BlockStore, owner: str, *hashes: int) -> PutGrant:
    grant = store.reserve(f"p-{owner}-{hashes}", L, hashes, 10.0, owner)
    assert isinstance(grant, PutGrant), grant
    store.commit(grant.put_id, [True] * len(grant.slots))
    return grant


def held(store: BlockStore, *hashes: int) -> list[int]:
    return [h for h in hashes if (h, L) in store.index or (
        store.disk is not None and (h, L) in store.disk.index
    )]  # fmt: skip


def test_a_block_records_the_writer_that_committed_it_and_keeps_its_first() -> None:
    store = BlockStore(8)
    stored(store, "decode-0", 1, 2)
    stored(store, "decode-1", 2, 3)  # 2 is present: decode-0's copy stays
    assert [store.owners.owner((h, L)) for h in (1, 2, 3)] == ["decode-0", "decode-0", "decode-1"]
    assert (store.owners.count("decode-0"), store.owners.count("decode-1")) == (2, 1)


def test_a_writer_at_its_quota_recycles_its_own_oldest_blocks_not_others() -> None:
    store = BlockStore(8, max_per_owner=3)
    stored(store, "victim", 10, 11)
    stored(store, "greedy", 1, 2, 3)
    grant = stored(store, "greedy", 4, 5)  # past its quota: its 1 and 2 make room
    assert grant.write_hashes == (4, 5)
    assert held(store, 1, 2, 3, 4, 5, 10, 11) == [3, 4, 5, 10, 11]
    assert store.owners.count("greedy") == 3 and store.counters.quota_evictions == 2


def test_a_writer_at_its_quota_with_every_block_pinned_gets_no_slot_but_no_error() -> None:
    store = BlockStore(8, max_per_owner=2)
    stored(store, "w", 1, 2)
    assert store.lookup("g", L, [1, 2], 10.0).block_hashes == (1, 2)  # pinned by a get
    grant = store.reserve("p", L, [3], 10.0, "w")
    assert isinstance(grant, PutGrant) and grant.slots == () and store.num_free == 6


def test_a_writer_at_its_quota_in_a_store_full_of_pinned_blocks_is_told_so() -> None:
    store = BlockStore(2, max_per_owner=2)
    stored(store, "w", 1, 2)
    assert store.lookup("g", L, [1, 2], 10.0).block_hashes == (1, 2)
    assert isinstance(store.reserve("p", L, [3], 10.0, "w"), StoreFull)


def test_reserved_slots_count_toward_the_quota() -> None:
    store = BlockStore(8, max_per_owner=2)
    first = store.reserve("p1", L, [1, 2], 10.0, "w")
    second = store.reserve("p2", L, [3], 10.0, "w")
    assert isinstance(first, PutGrant) and isinstance(second, PutGrant)
    assert (len(first.slots), len(second.slots)) == (2, 0)


def stored_with_spills(store: BlockStore, owner: str, *hashes: int) -> None:
    grant = stored(store, owner, *hashes)
    for spill in grant.spills:  # the copies to disk the service makes before its reply
        store.spilled(spill, True)


def test_dropping_a_writer_evicts_its_blocks_in_every_tier_and_cancels_its_puts() -> None:
    store = BlockStore(2, disk=DiskSlots(4))
    stored_with_spills(store, "bad", 1, 2)
    stored_with_spills(store, "good", 3, 4)  # 1 and 2 go to disk
    assert held(store, 1, 2, 3, 4) == [1, 2, 3, 4] and (1, L) in store.disk.index
    inflight = store.reserve("bad-put", L, [9], 10.0, "bad")
    assert isinstance(inflight, PutGrant) and inflight.slots
    for spill in inflight.spills:
        store.spilled(spill, True)
    assert store.drop_owner("bad") == ["bad-put"]
    assert held(store, 1, 2, 3, 4) == [3, 4]
    assert store.owners.count("bad") == 0 and store.counters.owner_drops == 2
    assert store.lookup("g", L, [1], 10.0).block_hashes == ()


def test_dropping_a_writer_whose_block_a_get_holds_frees_the_slot_when_the_get_ends() -> None:
    store = BlockStore(4)
    stored(store, "bad", 1)
    stored(store, "good", 2)
    assert store.lookup("g", L, [1], 10.0).block_hashes == (1,)
    store.drop_owner("bad")
    assert store.lookup("g2", L, [1], 10.0).block_hashes == ()  # no longer served
    assert store.num_free == 2  # its slot is still held by the first get
    store.release("g")
    assert store.num_free == 3 and held(store, 1, 2) == [2]


def test_owner_counts_follow_blocks_that_leave_by_plain_eviction() -> None:
    store = BlockStore(2)
    stored(store, "a", 1, 2)
    stored(store, "b", 3, 4)  # evicts a's blocks (no disk tier: dropped)
    assert store.owners.count("a") == 0 and store.owners.count("b") == 2
    assert len(store.owners) == 2


def test_writer_quota_is_a_share_of_host_and_disk_blocks() -> None:
    assert writer_quota(0.5, 8, 0) == 4 and writer_quota(0.5, 4, 16) == 10
    assert writer_quota(0.01, 4, 0) == 1 and writer_quota(1.0, 8, 8) == 0  # 0: no limit
    owners = BlockOwners()
    owners.record((1, L), "x")
    owners.record((1, L), "y")
    assert owners.owner((1, L)) == "x" and owners.count("y") == 0


def test_a_writer_at_its_quota_recycles_its_disk_blocks_before_its_host_blocks() -> None:
    store = BlockStore(2, disk=DiskSlots(4), max_per_owner=4)
    stored_with_spills(store, "w", 1, 2)
    stored_with_spills(store, "w", 3, 4)  # 1 and 2 go to disk: the writer's oldest
    assert (1, L) in store.disk.index and (3, L) in store.index
    stored_with_spills(store, "w", 5)  # at its quota: 1 (least recently used, on disk) goes
    assert held(store, 1, 2, 3, 4, 5) == [2, 3, 4, 5]
    stored_with_spills(store, "w", 6)  # then 2, the next oldest, not its newest host block
    assert held(store, 1, 2, 3, 4, 5, 6) == [3, 4, 5, 6]
    assert store.owners.count("w") == 4 and store.counters.quota_evictions == 2


def test_a_writer_at_its_quota_recycles_its_least_recently_used_disk_block() -> None:
    store = BlockStore(1, disk=DiskSlots(4), max_per_owner=3)
    for h in (1, 2, 3):
        stored_with_spills(store, "w", h)  # 1 and 2 on disk, 1 older
    store.release(_promoted(store, 1))  # a get reads 1 back: now the newest, on host
    assert (1, L) in store.index and (2, L) in store.disk.index and (3, L) in store.disk.index
    stored_with_spills(store, "w", 4)  # its least recently used is 2
    assert held(store, 1, 2, 3, 4) == [1, 3, 4]


def _promoted(store: BlockStore, h: int) -> str:
    grant = store.lookup(f"g{h}", L, [h], 10.0)
    for spill in grant.spills:
        store.spilled(spill, True)
    for promotion in grant.promotions:
        assert store.promoted(grant.get_id, promotion, True)
    return grant.get_id


def test_store_metrics_count_evictions_by_reason() -> None:
    from kvmesh.services.kv_store.metrics import StoreMetrics
    from kvmesh.shared.transport.base import TransportStats

    store = BlockStore(2, disk=DiskSlots(1), max_per_owner=2)
    stored_with_spills(store, "a", 1)
    stored_with_spills(store, "b", 2)
    stored_with_spills(store, "b", 3)  # host room: 1 spilled
    stored_with_spills(store, "b", 4)  # b's quota: its 2 goes
    stored_with_spills(store, "c", 5)  # host room: 3 spilled, and disk room: 1 dropped
    store.drop_owner("b")  # writer gone: its 3 and 4
    registry = StoreMetrics(store, TransportStats, 64).registry
    by_reason = {
        reason: registry.get_sample_value(
            "kvmesh_store_evictions_by_reason_total", {"reason": reason}
        )
        for reason in ("host_room", "disk_room", "quota", "writer_gone", "failed_copy")
    }
    assert by_reason == {
        "host_room": 2,
        "disk_room": 1,
        "quota": 1,
        "writer_gone": 2,
        "failed_copy": 0,
    }
