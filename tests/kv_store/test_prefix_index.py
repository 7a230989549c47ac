"""The prefix cache's reports and the registry's index of them: the hash chain the engine and the
registry share, the bounded event log, the decode worker's reporter, and PrefixIndex (insert,
LRU eviction, removal, gaps, digests, epochs, dropped workers)."""

from __future__ import annotations

from kvmesh.services.decode.cache_reports import CacheReporter
from kvmesh.services.kv_registry.prefix_index import PrefixIndex
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.cache_events import CacheEventLog
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.kv.prefix_hash import (
    layout_root,
    prefix_block_hashes,
    reusable_prefix_hashes,
)
from kvmesh.shared.text.sampling import SamplingOptions

BS = 4


def run_prompt(bm: BlockManager, tokens: list[int], rid: str = "r") -> Sequence:
    """Allocate, 'compute' every token, commit: what a prefill leaves in the cache."""
    seq = Sequence(rid, list(tokens), SamplingOptions(temperature=0))
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq


# --- the shared hash chain ----------------------------------------------------------------------


def test_engine_block_hashes_equal_the_shared_function_under_a_layout_root() -> None:
    root = layout_root("4x2x64:bs4:float32:model-abcd")
    bm = BlockManager(32, BS, root_hash=root)
    tokens = [7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4]
    seq = run_prompt(bm, tokens)
    assert seq.block_hashes == prefix_block_hashes(tokens, BS, root)
    assert set(bm.hash_to_block) == set(prefix_block_hashes(tokens, BS, root))
    # a prompt that shares 2 blocks: what the registry would match is what the engine reuses
    other = [*tokens[:8], 3, 3, 3, 3, 3]
    second = Sequence("s", other, SamplingOptions(temperature=0))
    bm.allocate(second)
    assert second.num_computed_tokens == 8
    assert reusable_prefix_hashes(other, BS, root)[:2] == seq.block_hashes[:2]


def test_layout_root_separates_models_and_keeps_empty_as_the_plain_chain() -> None:
    tokens = list(range(8))
    a = prefix_block_hashes(tokens, BS, layout_root("L4-H2-D64:model-a"))
    b = prefix_block_hashes(tokens, BS, layout_root("L4-H2-D64:model-b"))
    assert not set(a) & set(b)
    assert layout_root("") == 0
    assert prefix_block_hashes(tokens, BS) == run_prompt(BlockManager(8, BS), tokens).block_hashes


def test_reusable_hashes_leave_the_block_of_the_last_token_out() -> None:
    assert len(reusable_prefix_hashes(list(range(8)), BS)) == 1  # 8 tokens: 2 full, 1 reusable
    assert len(reusable_prefix_hashes(list(range(9)), BS)) == 2
    assert reusable_prefix_hashes([1], BS) == []


def test_engine_hashes_of_a_real_prompt_match_what_the_registry_computes(tiny) -> None:
    """The engine roots its chain in its own kv_spec (the string its decode advert carries)."""
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    model, tokenizer = tiny
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64, block_size=16))
    prompt = tokenizer.encode(
        "The registry places a request where its prefix is cached, so that the decode "
        "worker computes only the uncached suffix of a long shared system prompt."
    )
    assert len(prompt) > 32
    engine.generate([prompt], SamplingOptions(max_tokens=1, temperature=0.0))
    expected = prefix_block_hashes(prompt, 16, layout_root(engine.kv_spec))
    assert expected and set(expected) <= set(engine.block_manager.hash_to_block)


# --- the event log and the reporter -------------------------------------------------------------


def test_event_log_keeps_the_latest_change_per_hash() -> None:
    log = CacheEventLog(8)
    log.on_stored(1)
    log.on_stored(2)
    log.on_removed(1)
    batch = log.take()
    assert (batch.stored, batch.removed, batch.overflowed) == ((2,), (1,), False)
    assert log.take().stored == ()


def test_event_log_overflow_drops_changes_and_says_so() -> None:
    log = CacheEventLog(2)
    for h in range(3):
        log.on_stored(h)
    log.on_stored(9)  # after the overflow: not recorded either
    batch = log.take()
    assert batch.overflowed and batch.stored == () and batch.removed == ()
    log.on_stored(5)
    assert log.take() == type(batch)((5,), (), False)


def test_block_manager_reports_stored_on_commit_and_removed_on_eviction() -> None:
    bm = BlockManager(3, BS)
    reporter = CacheReporter("d0", bm, max_events=16)
    first = reporter.digest()  # a new worker starts with a digest
    assert (first.seq, first.hashes, first.num_cached_blocks) == (1, (), 0)
    seq = run_prompt(bm, list(range(8)))  # 2 full blocks cached
    events = reporter.events()
    assert events is not None and events.seq == 2
    assert events.stored == tuple(seq.block_hashes) and events.removed == ()
    bm.deallocate(seq)
    other = run_prompt(bm, [50, 51, 52, 53, 54, 55, 56, 57, 58], "o")  # 3 blocks: evicts both
    events = reporter.events()
    assert events is not None and events.seq == 3
    assert set(events.removed) == set(seq.block_hashes)
    assert events.stored == tuple(other.block_hashes)
    assert reporter.events() is None  # nothing changed since


def test_reporter_sends_a_digest_instead_of_an_overflowed_batch() -> None:
    bm = BlockManager(16, BS)
    reporter = CacheReporter("d0", bm, max_events=2)
    reporter.digest()
    seq = run_prompt(bm, list(range(16)))  # 4 blocks > 2 events
    assert reporter.events() is None and reporter.needs_digest
    digest = reporter.digest()
    assert digest.seq == 2 and digest.hashes == tuple(seq.block_hashes)
    assert not reporter.needs_digest


# --- the registry's index ---------------------------------------------------------------------


def events(seq: int, stored=(), removed=(), worker="d0", epoch="e1") -> KvCacheEvents:
    return KvCacheEvents(worker, epoch, seq, tuple(stored), tuple(removed))


def digest(seq: int, hashes=(), worker="d0", epoch="e1") -> KvCacheDigest:
    return KvCacheDigest(worker, epoch, seq, tuple(hashes), num_cached_blocks=len(hashes))


def test_index_matches_the_leading_blocks_a_worker_holds() -> None:
    index = PrefixIndex()
    index.apply_digest(digest(1, [10, 11]))
    index.apply_events(events(2, stored=[12, 20]))
    assert index.matched_blocks("d0", [10, 11, 12, 13]) == 3
    assert index.matched_blocks("d0", [99, 11, 12]) == 0  # a prefix, not any block
    assert index.matched_blocks("d1", [10]) == 0
    assert index.holders(10) == {"d0"}
    index.apply_events(events(3, removed=[11]))
    assert index.matched_blocks("d0", [10, 11, 12]) == 1
    assert index.holders(11) == frozenset() and len(index) == 3


def test_index_evicts_least_recently_used_hashes_per_worker() -> None:
    index = PrefixIndex(max_blocks_per_worker=3)
    index.apply_digest(digest(1, [1, 2, 3]))
    index.touch("d0", [1])  # a placement used it: 2 is now the oldest
    index.apply_events(events(2, stored=[4]))
    assert index.num_blocks("d0") == 3
    assert index.matched_blocks("d0", [2]) == 0
    assert index.matched_blocks("d0", [1]) == 1 and index.holders(2) == frozenset()


def test_index_gap_marks_the_worker_unsynced_until_a_digest() -> None:
    index = PrefixIndex()
    index.apply_digest(digest(1, [1]))
    assert index.is_synced("d0")
    index.apply_events(events(3, stored=[2]))  # seq 2 was lost
    assert not index.is_synced("d0") and index.num_gaps == 1
    assert index.matched_blocks("d0", [1]) == 1  # what is known is kept meanwhile
    index.apply_digest(digest(4, [2, 5]))  # replaces everything known of d0
    assert index.is_synced("d0")
    assert index.matched_blocks("d0", [1]) == 0 and index.matched_blocks("d0", [2]) == 1


def test_index_ignores_messages_older_than_what_it_applied() -> None:
    index = PrefixIndex()
    index.apply_digest(digest(5, [1]))
    index.apply_events(events(4, removed=[1]))  # older than the digest
    index.apply_digest(digest(3, []))
    assert index.matched_blocks("d0", [1]) == 1 and index.is_synced("d0")


def test_index_starts_over_when_a_worker_restarts_under_its_id() -> None:
    index = PrefixIndex()
    index.apply_digest(digest(7, [1, 2]))
    index.apply_events(events(1, stored=[3], epoch="e2"))  # a new process: seq from 1
    assert index.matched_blocks("d0", [1]) == 0 and index.matched_blocks("d0", [3]) == 1
    assert index.is_synced("d0")


def test_registry_started_mid_stream_is_unsynced_until_the_digest() -> None:
    index = PrefixIndex()
    index.apply_events(events(40, stored=[1]))
    assert not index.is_synced("d0") and index.matched_blocks("d0", [1]) == 1


def test_dropping_a_worker_forgets_its_hashes_only() -> None:
    index = PrefixIndex()
    index.apply_digest(digest(1, [1, 2]))
    index.apply_digest(digest(1, [2, 3], worker="d1"))
    index.drop_worker("d0")
    assert index.holders(2) == {"d1"} and index.holders(1) == frozenset()
    assert index.num_blocks("d0") == 0 and len(index) == 2
