"""The kv-store's pure parts: slots, pins and LRU (services/kv_store/core.py), the block header
and its checks (shared/kv/kv_block_header.py), the store's layout string, the registry's store
table."""

from __future__ import annotations

import pytest
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.services.kv_store.core import BlockStore
from kvmesh.services.kv_store.grants import GetGrant, PutGrant, StoreFull
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.kv.kv_block_header import (
    HEADER_BYTES,
    BlockHeader,
    BlockVerifyError,
    check_stored,
    make_header,
    token_digests,
    verify_block,
)
from support.adverts import idle_store_advert, with_fields

L = 7  # a layout root


def put(store: BlockStore, put_id: str, hashes, expires_at: float = 10.0):
    verdict = store.reserve(put_id, L, hashes, expires_at)
    assert isinstance(verdict, PutGrant), verdict
    return verdict


def stored(store: BlockStore, *hashes: int) -> None:
    grant = put(store, f"p{hashes}", hashes)
    store.commit(grant.put_id, [True] * len(grant.slots))


def test_put_reserves_missing_blocks_and_commit_indexes_only_good_ones() -> None:
    store = BlockStore(4)
    stored(store, 1)
    grant = put(store, "p", [1, 2, 3, 2])  # 1 is there; 2 offered twice is written once
    assert grant.present == (1,) and grant.write_hashes == (2, 3) and len(set(grant.slots)) == 2
    assert store.num_pinned == 2
    committed, rejected = store.commit("p", [True, False])
    assert (committed, rejected) == ([2], [3])
    assert store.num_used == 2 and store.num_free == 2 and store.num_pinned == 0
    assert store.counters.rejected == 1


def test_get_pins_the_leading_run_only_and_release_unpins() -> None:
    store = BlockStore(4)
    stored(store, 1, 2, 4)
    grant = store.lookup("g", L, [1, 2, 3, 4], 10.0)
    assert isinstance(grant, GetGrant) and grant.block_hashes == (1, 2)  # 4 is after a gap
    assert (store.counters.hits, store.counters.misses) == (2, 2)
    assert store.num_pinned == 2
    assert store.release("g") and not store.release("g")
    assert store.num_pinned == 0


def test_get_of_another_layout_misses() -> None:
    store = BlockStore(2)
    stored(store, 1)
    assert store.lookup("g", L + 1, [1], 10.0).block_hashes == ()


def test_full_store_evicts_the_least_recently_used_unpinned_block() -> None:
    store = BlockStore(2)
    stored(store, 1)
    stored(store, 2)
    store.lookup("g", L, [1], 10.0)
    store.release("g")  # 1 used after 2: 2 is the least recently used
    grant = put(store, "p", [3])
    store.commit("p", [True])
    assert store.counters.evictions == 1
    assert store.lookup("g2", L, [2], 10.0).block_hashes == ()
    assert store.lookup("g3", L, [1], 10.0).block_hashes == (1,)
    assert grant.write_hashes == (3,)


def test_store_full_of_pinned_blocks_refuses_a_put_and_waits_for_nothing() -> None:
    store = BlockStore(2)
    stored(store, 1, 2)
    store.lookup("g", L, [1, 2], 10.0)  # every block pinned by a reader
    verdict = store.reserve("p", L, [3], 10.0)
    assert isinstance(verdict, StoreFull) and "full of pinned blocks" in verdict.error
    assert store.counters.refused_puts == 1
    assert put(store, "p2", [1]).present == (1,)  # what it holds is still answered
    store.release("g")
    assert put(store, "p3", [3]).write_hashes == (3,)


def test_put_gets_what_room_there_is_in_order() -> None:
    store = BlockStore(2)
    stored(store, 1)
    store.lookup("g", L, [1], 10.0)
    grant = put(store, "p", [5, 6, 7])
    assert grant.write_hashes == (5,) and len(grant.slots) == 1


def test_expired_put_frees_its_slots_and_expired_get_unpins() -> None:
    store = BlockStore(2)
    put(store, "p", [1], expires_at=1.0)
    stored(store, 2)
    store.lookup("g", L, [2], 1.0)
    assert store.expire(0.5) == ([], [])
    assert store.expire(1.0) == (["p"], ["g"])
    assert store.num_pinned == 0 and store.num_free == 1
    assert store.commit("p", [True]) == ([], [])  # too late: never indexed


def test_commit_of_a_hash_committed_meanwhile_keeps_the_first_copy() -> None:
    store = BlockStore(4)
    a, b = put(store, "a", [9]), put(store, "b", [9])
    store.commit("a", [True])
    assert store.commit("b", [True]) == ([9], [])
    assert store.num_used == 1 and store.num_free == 3
    assert store.lookup("g", L, [9], 10.0).slots == a.slots != b.slots


# --- headers ------------------------------------------------------------------------------------


def test_header_round_trips_and_a_reader_accepts_the_block_it_names() -> None:
    block = bytes(range(256)) * 4
    [digest] = token_digests(list(range(16)), 16, "spec", 1)
    header = make_header(0xABC, L, digest, block)
    raw = header.pack()
    assert len(raw) == HEADER_BYTES and BlockHeader.unpack(raw) == header
    verify_block(raw, block, 0xABC, L, digest)


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("hash", "names hash"),
        ("layout", "names layout"),
        ("bytes", "CRC32"),
        ("collision", "token digest"),
        ("empty", "no block header"),
    ],
)
def test_reader_refuses_a_block_that_is_not_the_one_asked_for(case: str, match: str) -> None:
    block = bytearray(b"\x01" * 1024)
    d_mine, d_other = token_digests([1] * 16, 16, "spec", 1), token_digests([2] * 16, 16, "spec", 1)
    raw = make_header(0xABC, L, d_mine[0], block).pack()
    args = {"hash": 0xABC, "layout": L, "digest": d_mine[0]}
    if case == "hash":
        args["hash"] = 0xABD
    elif case == "layout":
        args["layout"] = L + 1
    elif case == "bytes":
        block[100] ^= 0xFF
    elif case == "collision":  # same 64-bit hash, other tokens: the token digest differs
        args["digest"] = d_other[0]
    else:
        raw = bytes(HEADER_BYTES)
    with pytest.raises(BlockVerifyError, match=match):
        verify_block(raw, block, args["hash"], args["layout"], args["digest"])


def test_token_digests_chain_over_blocks_and_depend_on_the_layout() -> None:
    tokens = list(range(48))
    d = token_digests(tokens, 16, "spec", 3)
    assert len(d) == 3 and len(set(d)) == 3 and all(len(x) == 16 for x in d)
    assert token_digests(tokens, 16, "spec", 2) == d[:2]
    assert token_digests(tokens, 16, "other", 1)[0] != d[0]
    changed = [99, *tokens[1:]]
    assert token_digests(changed, 16, "spec", 3)[2] != d[2]  # block 2 stands for blocks 0-2


def test_store_checks_the_reserved_hash_at_commit() -> None:
    block = b"\x02" * 64
    header = make_header(5, L, bytes(16), block)
    check_stored(header, 5, L, block)
    with pytest.raises(BlockVerifyError):
        check_stored(header, 6, L, block)


# --- layout and the registry's view -------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8_e4m3", "float16"])
def test_store_layout_of_the_tiny_model_is_the_decode_engines_kv_spec(
    tiny, kv_cache_dtype: str
) -> None:
    from kvmesh.services.kv_store.layout import store_layout
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    spec, kv_spec = store_layout("kvmesh-tiny", None, 16, kv_cache_dtype)
    model, tokenizer = tiny
    econf = EngineConfig(block_size=16, num_blocks=4, kv_cache_dtype=kv_cache_dtype)
    engine = LLMEngine(model, tokenizer, econf)
    assert kv_spec == engine.kv_spec
    assert spec.block_bytes == engine.kv_pool.spec.block_bytes


def test_registry_store_table_reports_hit_rate_and_drops_silent_stores() -> None:
    from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor

    desc = TransportDescriptor("s", "h", (TcpBackend("x", 1, "ab" * 32),))

    def advert(epoch: str, hits: int, misses: int) -> StoreAdvert:
        empty = idle_store_advert(
            "s0", desc, kv_spec="spec", block_bytes=64, block_size=16, total_blocks=10, epoch=epoch
        )
        return with_fields(empty, used_blocks=4, pinned_blocks=1, hits=hits, misses=misses)

    table = StoreTable(timeout_s=3.0)
    assert table.observe(advert("e1", 3, 1), 0.0)
    assert not table.observe(advert("e1", 3, 1), 1.0)
    assert table.observe(advert("e2", 0, 0), 1.5)  # restarted: a new epoch, an empty store
    table.observe(advert("e2", 3, 1), 2.0)
    [row] = table.status(2.0)
    assert (row.hit_rate, row.load.used_blocks, row.capacity_bytes) == (0.75, 4, 640)
    assert table.expire(4.0) == [] and table.expire(5.1) == ["s0"] and table.status(6.0) == ()


def test_store_book_picks_the_lowest_ready_store_of_its_layout_heard_of_lately() -> None:
    from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
    from kvmesh.shared.mesh.store_book import StoreBook

    desc = TransportDescriptor("s", "h", (TcpBackend("x", 1, "ab" * 32),))

    def advert(store_id: str, kv_spec: str = "spec", block_bytes: int = 64, state: str = "ready"):
        empty = idle_store_advert(
            store_id, desc, kv_spec=kv_spec, block_bytes=block_bytes, block_size=16, total_blocks=8
        )
        return with_fields(empty, state=state)

    now = [0.0]
    book = StoreBook("spec", 64, clock=lambda: now[0])
    assert book.target() is None
    book.note(advert("s2"))
    book.note(advert("s0", kv_spec="other"))  # another layout: of no use
    book.note(advert("s1", block_bytes=128))  # another block size
    book.note(advert("s3", state="draining"))
    assert book.target().store_id == "s2"
    now[0] = 3.0
    book.note(advert("s1"))
    assert book.target().store_id == "s1"
    book.forget("s1")  # a request to it failed: the next live one, until s1 advertises again
    assert book.target().store_id == "s2"
    book.note(advert("s1"))
    assert book.target().store_id == "s1"
    now[0] = 9.0  # both silent for longer than the TTL
    assert book.target() is None


def test_cancelled_put_gives_its_slots_back_unwritten() -> None:
    store = BlockStore(2)
    put(store, "p", [1, 2])
    assert store.num_free == 0
    store.cancel_put("p")
    assert store.num_free == 2 and store.num_pinned == 0 and store.commit("p", []) == ([], [])


# --- the disk tier (services/kv_store/disk_tier.py) ----------------------------------------------


def tiered(num_host: int, num_disk: int) -> BlockStore:
    from kvmesh.services.kv_store.disk_tier import DiskSlots

    return BlockStore(num_host, disk=DiskSlots(num_disk))


def spill_all(store: BlockStore, spills) -> None:
    for spill in spills:
        store.spilled(spill, True)


def test_put_spills_the_evicted_host_block_to_disk_instead_of_dropping_it() -> None:
    store = tiered(2, 4)
    stored(store, 1, 2)
    grant = put(store, "p", [3])
    [spill] = grant.spills
    assert spill.key == (1, L) and spill.host_slot == grant.slots[0]  # the LRU host block
    again = put(store, "q", [1])  # in transit: present, not written twice
    assert again.present == (1,) and again.slots == ()
    assert store.lookup("g", L, [1], 10.0).block_hashes == ()  # in transit: not served yet
    store.spilled(spill, True)
    store.commit("p", [True])
    assert (store.num_used, store.disk.num_used) == (2, 1)
    assert (store.counters.evictions, store.counters.spills) == (1, 1)


def test_get_promotes_disk_blocks_into_host_slots_spilling_host_ones() -> None:
    store = tiered(2, 4)
    stored(store, 1, 2)
    grant = put(store, "p", [3, 4])  # 1 and 2 go to disk
    spill_all(store, grant.spills)
    store.commit("p", [True, True])
    got = store.lookup("g", L, [1, 2], 10.0)
    assert got.block_hashes == (1, 2)
    assert [p.key for p in got.promotions] == [(1, L), (2, L)]
    assert {s.key for s in got.spills} == {(3, L), (4, L)}
    assert [p.host_slot for p in got.promotions] == list(got.slots)
    # a spill never lands in a disk slot that a promotion has yet to read
    assert not {s.disk_slot for s in got.spills} & {p.disk_slot for p in got.promotions}
    spill_all(store, got.spills)
    assert all(store.promoted("g", p, True) for p in got.promotions)
    assert (store.counters.disk_hits, store.counters.promotions) == (2, 2)
    assert store.release("g")
    assert sorted(store.index) == [(1, L), (2, L)] and sorted(store.disk.index) == [(3, L), (4, L)]


def test_get_run_ends_where_no_host_slot_is_left_and_gives_the_rest_back() -> None:
    store = tiered(1, 4)
    stored(store, 1)
    grant = put(store, "p", [2])  # 1 to disk
    spill_all(store, grant.spills)
    store.commit("p", [True])
    hold = store.lookup("h", L, [2], 10.0)  # pins the only host slot
    got = store.lookup("g", L, [1], 10.0)
    assert got.block_hashes == () and got.promotions == ()
    assert store.disk.index == {(1, L): grant.spills[0].disk_slot}  # still on disk, servable
    assert store.release(hold.get_id)
    assert store.lookup("g2", L, [1], 10.0).block_hashes == (1,)


def test_promotion_after_the_get_expired_is_not_indexed_and_frees_its_slot() -> None:
    store = tiered(2, 2)
    stored(store, 1)
    stored(store, 2)
    grant = put(store, "p", [3])  # 1 to disk
    spill_all(store, grant.spills)
    store.commit("p", [True])
    got = store.lookup("g", L, [1], 1.0)
    spill_all(store, got.spills)
    store.expire(2.0)  # the lease ends while the copy is in flight
    assert not store.promoted("g", got.promotions[0], True)
    assert (1, L) not in store.index and store.num_free == 1  # the slot it had is free
    assert len(store.disk.free) == 1 and list(store.disk.index) == [(2, L)]


def test_failed_copies_drop_the_block_and_free_the_disk_slot() -> None:
    store = tiered(1, 1)
    stored(store, 1)
    grant = put(store, "p", [2])
    store.spilled(grant.spills[0], False)
    assert store.disk.num_used == 0 and store.disk.free == [0]
    assert store.counters.failed_copies == 1
    assert store.lookup("g", L, [1], 10.0).block_hashes == ()


def test_full_disk_tier_drops_its_least_recently_used_block() -> None:
    store = tiered(1, 1)
    for h in (1, 2, 3):  # each put evicts the previous host block to the one disk slot
        grant = put(store, f"p{h}", [h])
        spill_all(store, grant.spills)
        store.commit(grant.put_id, [True])
    assert list(store.disk.index) == [(2, L)] and store.disk.num_evictions == 1
    assert list(store.index) == [(3, L)]
