"""kv-stores in the registry's prefix index: a store reports what it holds (held_reports.py:
a digest first, then the changes, a digest again when a change does not fit), the registry
indexes it per store (only stores it knows by their adverts, forgotten when they restart or go
silent), counts how many leading blocks of a placed prompt the store its decode worker reads
holds, and places by them: a worker that reads a store is credited with the blocks it would
read (half a cached block each), and makes a local prefill of a short suffix past them;
``admin status`` shows each store's indexed blocks."""

from __future__ import annotations

from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.placement_policy import Candidate
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.services.kv_store.core import BlockStore
from kvmesh.services.kv_store.disk_tier import DiskSlots
from kvmesh.services.kv_store.held_reports import HeldReporter, change_mark, held_hashes
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.kv.prefix_hash import layout_root, prefix_block_hashes
from support.adverts import idle_store_advert, with_fields
from test_registry_core import BLOCK_SIZE, advert
from test_registry_prefix import KV_SPEC, PREFIX, holds, place, prompt

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)

LAYOUT = 7


def store_advert(
    store_id: str = "s0", epoch: str = "e1", *, kv_spec: str = KV_SPEC, state: str = "ready"
) -> StoreAdvert:
    desc = TransportDescriptor(store_id, "h", (TcpBackend("127.0.0.1", 1, SECRET),))
    empty = idle_store_advert(
        store_id,
        desc,
        kv_spec=kv_spec,
        block_bytes=64,
        block_size=BLOCK_SIZE,
        total_blocks=100,
        epoch=epoch,
    )
    return with_fields(empty, state=state)


def committed(store: BlockStore, hashes: list[int], put_id: str) -> None:
    grant = store.reserve(put_id, LAYOUT, hashes, expires_at=10.0)
    store.commit(put_id, [True] * len(grant.slots))


# --- the store's side -----------------------------------------------------------------------------


def test_a_store_reports_everything_first_then_only_what_changed() -> None:
    store = BlockStore(4)
    reporter = HeldReporter("s0", "e1")
    committed(store, [11, 12], "p1")
    first = reporter.events(held_hashes(store))
    assert isinstance(first, KvCacheDigest)  # the registry knows nothing yet
    assert (first.worker_id, first.epoch, first.seq, first.hashes) == ("s0", "e1", 1, (11, 12))
    assert reporter.events(held_hashes(store)) is None  # nothing moved
    committed(store, [13, 14, 15], "p2")  # 4 slots: 11, the least recently used, is evicted
    change = reporter.events(held_hashes(store))
    assert change == KvCacheEvents("s0", "e1", 2, stored=(13, 14, 15), removed=(11,))


def test_a_change_too_large_for_one_message_is_sent_as_a_digest() -> None:
    store = BlockStore(8)
    reporter = HeldReporter("s0", max_hashes=2)
    reporter.digest(held_hashes(store))
    committed(store, [1, 2, 3], "p1")
    msg = reporter.events(held_hashes(store))
    assert isinstance(msg, KvCacheDigest)
    assert (msg.hashes, msg.num_cached_blocks) == ((2, 3), 3)  # the newest that fit


def test_blocks_spilled_to_disk_are_still_held_and_change_the_mark() -> None:
    store = BlockStore(2, disk=DiskSlots(4))
    committed(store, [1, 2], "p1")
    mark = change_mark(store)
    grant = store.reserve("p2", LAYOUT, [3], expires_at=10.0)
    assert change_mark(store) != mark
    [spill] = grant.spills  # 1 goes to disk: in transit until the copy is done
    assert sorted(held_hashes(store)) == [1, 2]  # 3 is not committed yet
    store.spilled(spill, ok=True)
    store.commit("p2", [True])
    assert sorted(held_hashes(store)) == [1, 2, 3]


# --- the registry's side ------------------------------------------------------------------------


def chain(tokens: list[int]) -> tuple[int, ...]:
    return tuple(prefix_block_hashes(tokens, BLOCK_SIZE, layout_root(KV_SPEC)))


def test_registry_indexes_only_known_stores_and_forgets_a_restarted_or_silent_one() -> None:
    table = StoreTable(timeout_s=3.0)
    digest = KvCacheDigest("s0", "e1", 1, chain(PREFIX))
    assert not table.observe_digest(digest)  # no advert yet: not a store it knows
    table.observe(store_advert(), 0.0)
    assert table.observe_digest(digest)
    [row] = table.status(0.0)
    assert (row.indexed_blocks, row.index_synced) == (6, True)
    assert table.matched_blocks(KV_SPEC, chain(list(prompt(40)))) == 6
    assert table.matched_blocks("another layout", chain(PREFIX)) == 0
    assert table.observe_events(KvCacheEvents("s0", "e1", 2, removed=chain(PREFIX)[3:4]))
    assert table.matched_blocks(KV_SPEC, chain(PREFIX)) == 3  # a leading run: 4th gone
    table.observe(store_advert(epoch="e2"), 1.0)  # restarted: it holds nothing of before
    assert table.matched_blocks(KV_SPEC, chain(PREFIX)) == 0
    table.observe_digest(KvCacheDigest("s0", "e2", 1, chain(PREFIX)))
    table.observe(store_advert(epoch="e2", state="draining"), 1.5)
    assert table.matched_blocks(KV_SPEC, chain(PREFIX)) == 0  # a draining store serves none
    assert table.expire(5.0) == ["s0"] and not table.prefixes.workers


def test_placement_counts_the_prompt_blocks_a_store_holds() -> None:
    table = StoreTable(timeout_s=3.0)
    registry = RegistryState(worker_timeout_s=3.0, stores=table)
    registry.observe_advert(advert("a"), now=0.0)
    assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8)
    registry.release_inflight(Candidate("a", 8))
    table.observe(store_advert(), 0.0)
    table.observe_digest(KvCacheDigest("s0", "e1", 1, chain(PREFIX[: 4 * BLOCK_SIZE])))
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert choice == Candidate("a", 8, store_cached_tokens=4 * BLOCK_SIZE)


# --- placement by what stores hold ----------------------------------------------------------------


def registry_with_store(
    *workers: str, held: list[int] = PREFIX, store: StoreAdvert | None = None, **kw: object
) -> tuple[RegistryState, StoreTable]:
    """Decode workers that read the kv-store (``reads_kv_store``), and one store (ready, of
    their layout, unless ``store`` says otherwise) holding every full block of ``held``."""
    table = StoreTable(timeout_s=3.0)
    registry = RegistryState(worker_timeout_s=3.0, stores=table, **kw)  # type: ignore[arg-type]
    for w in workers:
        registry.observe_advert(advert(w, reads_kv_store=True), now=0.0)
    table.observe(store or store_advert(), 0.0)
    table.observe_digest(KvCacheDigest("s0", "e1", 1, chain(held)))
    return registry, table


def test_a_store_held_prefix_is_prefilled_locally_by_a_reader_with_room() -> None:
    registry, _ = registry_with_store("a", "b")
    registry.observe_advert(advert("a", reads_kv_store=True, free_blocks=4), now=0.0)  # full
    request = place(prompt(20))
    choice = registry.choose(request, now=0.0)
    # 116 tokens: nothing cached on b, 6 blocks (96 tokens) to read, 20 computed there
    assert choice == Candidate("b", 8, 0, 0, True, store_cached_tokens=96, read_tokens=96)
    reply = registry.grant(choice, request, "L1", (), now=0.0)
    assert reply.ok and reply.local_prefill and reply.cached_tokens == 0
    assert not registry.leases  # no prefill worker writes to it


def test_a_read_is_counted_past_the_own_cached_run_and_the_suffix_after_both() -> None:
    registry, _ = registry_with_store("a", local_max_suffix_tokens=20)
    holds(registry, "a", PREFIX[: 2 * BLOCK_SIZE])
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert choice == Candidate("a", 8, 2, 32, True, store_cached_tokens=96, read_tokens=64)
    registry.release_inflight(choice)
    choice = registry.choose(place(prompt(21)), now=0.0)  # 21 left past the 6 blocks: remote
    assert isinstance(choice, Candidate) and not choice.prefill_here


def test_own_cached_blocks_outscore_the_same_blocks_in_the_store() -> None:
    """score = prefix_weight * (cached + 0.5 * read) - 4 * load: the holder scores 6, a reader 3;
    one request more on the holder (6 - 4 = 2) makes the idle reader (3) the better place."""
    registry, _ = registry_with_store("a", "b")
    holds(registry, "b", PREFIX)
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert choice == Candidate("b", 8, 6, 96, True, store_cached_tokens=96)  # nothing to read
    registry.release_inflight(choice)
    registry.observe_advert(advert("b", reads_kv_store=True, num_running=1), now=0.0)
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate)
    assert (choice.worker_id, choice.prefill_here, choice.read_tokens) == ("a", True, 96)


def test_a_store_of_another_layout_or_not_ready_or_a_worker_that_cannot_read_is_ignored() -> None:
    registry, _ = registry_with_store("a")
    registry.observe_advert(advert("a"), now=0.0)  # no store reader (no transport, or off)
    only_counted = Candidate("a", 8, store_cached_tokens=96)
    assert registry.choose(place(prompt(20)), now=0.0) == only_counted
    for store in (
        store_advert(state="draining"),
        store_advert(kv_spec="32x8x128:bs16:bfloat16"),
    ):
        registry, _ = registry_with_store("a", store=store)
        assert registry.choose(place(prompt(20)), now=0.0) == Candidate("a", 8), store


def test_prefix_weight_or_store_block_weight_zero_turns_store_placement_off() -> None:
    for kw in ({"prefix_weight": 0.0}, {"store_block_weight": 0.0}):
        registry, _ = registry_with_store("a", "b", **kw)
        holds(registry, "b", PREFIX[:BLOCK_SIZE])
        choice = registry.choose(place(prompt(20)), now=0.0)
        # still counted (the metric), never read nor prefilled locally for it
        if kw == {"prefix_weight": 0.0}:  # by load alone: a
            assert choice == Candidate("a", 8, store_cached_tokens=96), kw
        else:  # b's own cached block still counts, and makes a local prefill of 100 tokens
            assert choice == Candidate("b", 8, 1, 16, True, store_cached_tokens=96), kw


def test_workers_read_the_ready_store_with_the_lowest_id_only() -> None:
    registry, table = registry_with_store("a", held=PREFIX[: 2 * BLOCK_SIZE])  # s0: 2 blocks
    table.observe(store_advert("s1"), 0.0)
    table.observe_digest(KvCacheDigest("s1", "e1", 1, chain(PREFIX)))  # s1: 6
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate) and choice.read_tokens == 32  # what s0 would give
    registry.release_inflight(choice)
    table.observe(store_advert(state="draining"), 0.0)  # s0 drains: s1 is read
    choice = registry.choose(place(prompt(20)), now=0.0)
    assert isinstance(choice, Candidate) and choice.read_tokens == 96
