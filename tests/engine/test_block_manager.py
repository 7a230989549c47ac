import pytest
from kvmesh.shared.engine.block_manager import BlockManager, OutOfBlocksError, block_hash
from kvmesh.shared.engine.handoff import PrefilledRequest, prefilled_sequence
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import SamplingOptions

BS = 4


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingOptions(temperature=0))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a forward pass computed every token of the sequence."""
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)


def computed_seq(bm: BlockManager, tokens: list[int], rid: str = "r") -> Sequence:
    """A sequence of ``tokens`` given its blocks by ``bm`` and computed: its full blocks cached."""
    seq = make_seq(tokens, rid)
    bm.allocate(seq)
    compute_all(bm, seq)
    return seq


def test_allocate_takes_blocks_for_every_token_and_deallocate_returns_them():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5 and bm.num_total_blocks == 8
    bm.deallocate(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []
    bm.check_invariants()


def test_can_allocate_false_when_pool_too_small():
    bm = BlockManager(2, BS)
    seq = make_seq(list(range(9)))
    assert not bm.can_allocate(seq)
    with pytest.raises(OutOfBlocksError):
        bm.allocate(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == 2


def test_prefix_hit_shares_full_computed_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)), "a")
    bm.allocate(a)
    assert a.num_computed_tokens == 0
    compute_all(bm, a)
    # Same 12 tokens: only the first 2 full blocks hit, the last token must be recomputed.
    b = make_seq(list(range(12)), "b")
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # Diverging in the second block: only the first block hits.
    c = make_seq([0, 1, 2, 3, 4, 99, 6, 7, 8], "c")
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    assert c.num_computed_tokens == 4
    bm.check_invariants()


def test_uncomputed_blocks_are_not_reused():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(12)), "a")
    bm.allocate(a)  # allocated but never computed: nothing enters the cache
    b = make_seq(list(range(12)), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    assert not set(a.block_table) & set(b.block_table)


def test_freed_cached_blocks_are_reused_until_evicted():
    bm = BlockManager(4, BS)
    a = computed_seq(bm, list(range(9)), "a")
    first_two = a.block_table[:2]
    bm.deallocate(a)
    assert bm.num_free_blocks == 4
    b = make_seq(list(range(9)), "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == first_two and b.num_computed_tokens == 8
    bm.deallocate(b)
    # A different prompt needing all 4 blocks evicts the cached ones.
    c = make_seq(list(range(100, 116)), "c")
    bm.allocate(c)
    bm.deallocate(c)
    d = make_seq(list(range(9)), "d")
    bm.allocate(d)
    assert d.num_computed_tokens == 0
    bm.check_invariants()


def test_uncached_free_blocks_are_handed_out_before_cached_ones():
    bm = BlockManager(6, BS)
    a = computed_seq(bm, list(range(9)), "a")
    bm.deallocate(a)
    fresh = bm.allocate_blocks(3)
    assert not set(fresh) & set(a.block_table[:2])
    assert len(bm.hash_to_block) == 2


def test_can_allocate_counts_free_cached_hits_against_the_free_list():
    bm = BlockManager(3, BS)
    a = computed_seq(bm, list(range(9)), "a")
    bm.deallocate(a)
    # 9 tokens -> 3 blocks; 2 are free cached hits, 1 fresh: exactly fits.
    b = make_seq(list(range(9)), "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_append_slots_grows_block_table_only_when_crossing_a_block_boundary():
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(4)))
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    seq.token_ids.append(4)
    assert bm.can_append(seq, 1)
    bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    bm.append_slots(seq, 3)
    assert len(seq.block_table) == 2
    assert bm.can_append(seq, 11) and not bm.can_append(seq, 12)  # 4 blocks hold 16 tokens


def test_allocate_blocks_and_free_blocks_reserve_for_remote_writer():
    bm = BlockManager(5, BS)
    ids = bm.allocate_blocks(3)
    assert len(set(ids)) == 3 and bm.num_free_blocks == 2
    with pytest.raises(OutOfBlocksError, match="3 KV blocks, 2 are free"):
        bm.allocate_blocks(3)
    bm.free_blocks(ids)
    assert bm.num_free_blocks == 5
    with pytest.raises(AssertionError):
        bm.free_blocks(ids)  # double free


def test_chained_hash_depends_on_parent():
    assert block_hash(None, [1, 2]) == block_hash(None, [1, 2])
    assert block_hash(1, [1, 2]) != block_hash(2, [1, 2])
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])


def test_truncate_frees_blocks_past_the_end():
    bm = BlockManager(8, BS)
    seq = computed_seq(bm, list(range(14)))
    copies = bm.truncate(seq, 6, 5)
    assert copies == []
    assert seq.token_ids == list(range(6)) and seq.num_computed_tokens == 5
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    # Block 1 is partial now: it must have left the prefix cache. Freed block 2 stays cached.
    assert bm.blocks[seq.block_table[1]].hash is None
    assert len(bm.hash_to_block) == 2
    bm.check_invariants()


def test_truncate_copies_a_shared_block_before_it_is_rewritten():
    bm = BlockManager(8, BS)
    a = computed_seq(bm, list(range(9)), "a")
    b = computed_seq(bm, list(range(9)), "b")
    shared = b.block_table[1]
    assert shared == a.block_table[1]
    copies = bm.truncate(b, 6, 6)
    assert copies == [(shared, b.block_table[1])] and b.block_table[1] != shared
    assert bm.blocks[shared].ref_count == 1 and bm.blocks[shared].hash is not None
    bm.check_invariants()


# --- blocks from and to a KV store ----------------------------------------------------------


def test_adopted_blocks_are_prefix_hits_for_the_next_sequence_after_they_are_freed():
    bm = BlockManager(8, BS, root_hash=5)
    tokens = list(range(13))  # 3 full blocks, the last one holds the last token's block too
    seq = make_seq(tokens)
    hashes = bm._ensure_hashes(seq, 3)
    ids = bm.allocate_blocks(2)  # as a store read fills them
    chunks = [tuple(tokens[i * BS : (i + 1) * BS]) for i in range(2)]
    assert bm.adopt(ids, hashes[:2], chunks) == 2
    assert bm.num_cached(hashes) == 2
    bm.free_blocks(ids)
    fresh = make_seq(tokens, "r2")
    bm.allocate(fresh)
    assert fresh.block_table[:2] == ids and fresh.num_computed_tokens == 2 * BS
    bm.check_invariants()


def test_adopt_leaves_a_hash_cached_already_as_it_is():
    bm = BlockManager(8, BS)
    seq = computed_seq(bm, list(range(9)))
    [h0, _] = seq.block_hashes
    [other] = bm.allocate_blocks(1)
    assert bm.adopt([other], [h0], [tuple(range(BS))]) == 0
    assert bm.hash_to_block[h0] == seq.block_table[0]
    bm.free_blocks([other])
    bm.check_invariants()


def test_pinned_cached_blocks_are_not_handed_out_until_freed():
    bm = BlockManager(3, BS)
    seq = computed_seq(bm, list(range(9)))
    hashes = list(seq.block_hashes)
    bm.deallocate(seq)  # cached, free
    pinned = bm.pin_cached([*hashes, 12345])  # stops at the first hash not cached
    assert len(pinned) == 2 and bm.num_free_blocks == 1
    assert bm.allocate_blocks(1)[0] not in pinned
    bm.free_blocks(pinned)
    assert bm.num_cached(hashes) == 2
    bm.check_invariants()


def test_prefilled_sequence_keeps_its_cached_prompt_chain_when_the_pool_is_pressed():
    """A remote prefill writes the whole prompt into blocks of its own; the cache's older copies
    of the prompt's blocks (an earlier turn of the chat) must be the ones the sequence holds, or
    allocations while it runs evict them and the chain a kv-store put walks breaks there."""
    bm = BlockManager(6, BS)
    params = SamplingOptions(temperature=0)
    turn1 = prefilled_sequence(
        PrefilledRequest("t1", list(range(8)), bm.allocate_blocks(2), 50, params), bm, 100
    )
    bm.deallocate(turn1)  # finished: its 2 blocks stay cached in the free list
    prompt = [*range(8), 50, 51, 52, 53]  # the history again and 4 new tokens: 3 full blocks
    turn2 = prefilled_sequence(
        PrefilledRequest("t2", prompt, bm.allocate_blocks(3), 60, params), bm, 100
    )
    hashes = list(turn2.block_hashes)
    others = bm.allocate_blocks(bm.num_free_blocks)  # other requests take every free block
    assert bm.num_cached(hashes) == 3  # the leading run a put of turn 2 would pin
    bm.free_blocks(others)
    bm.deallocate(turn2)
    assert len(bm.pin_cached(hashes)) == 3
    bm.check_invariants()


def test_share_cached_keeps_own_block_on_a_hash_collision():
    bm = BlockManager(6, BS)
    first = computed_seq(bm, list(range(5)))
    h0 = first.block_hashes[0]
    bm.blocks[first.block_table[0]].token_ids = (9, 9, 9, 9)  # another block's tokens, same hash
    seq = make_seq(list(range(5)), "r2")
    seq.block_table = bm.allocate_blocks(2)
    seq.num_computed_tokens = 4
    own = list(seq.block_table)
    assert bm.share_cached(seq) == 0 and seq.block_table == own
    assert bm.hash_to_block[h0] == first.block_table[0]
