from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.scheduler import Scheduler
from kvmesh.shared.engine.sequence import Sequence, SequenceStatus
from kvmesh.shared.text.sampling import SamplingOptions

BS = 4


def make_seq(n: int, rid: str, prefill_only: bool = False, start: int = 0) -> Sequence:
    return Sequence(
        rid,
        list(range(start, start + n)),
        SamplingOptions(temperature=0),
        prefill_only=prefill_only,
    )


def run(sched: Scheduler, batch, sampled: int = 7) -> None:
    """Apply a step: mark tokens computed, append a token where the prompt is done."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(sampled)


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=10)
    a = make_seq(25, "a")
    sched.add(a)
    sizes = []
    while a.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.num_tokens <= 10
        sizes.append(batch.num_new_tokens[0])
        run(sched, batch)
    assert sizes == [10, 10, 5]


def test_decodes_come_first_and_prefill_fills_the_rest_of_the_budget():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = make_seq(3, "a"), make_seq(20, "b")
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # a prefills (3), b gets the remaining 5
    assert a.num_output_tokens == 1 and b.num_computed_tokens == 5
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 7]


def test_max_num_seqs_limits_running_batch():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(3, str(i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and list(sched.waiting) == [seqs[2]]


def test_preemption_frees_latest_sequence_when_blocks_run_out():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # both prefilled: 4 blocks used, each has 9 tokens now
    assert bm.num_free_blocks == 0
    batch = sched.schedule()  # a needs a third block: b is preempted
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    bm.check_invariants()


def test_preempts_itself_when_nothing_else_can_go():
    bm = BlockManager(2, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(8, "a")
    sched.add(a)
    run(sched, sched.schedule())
    batch = sched.schedule()
    assert batch.seqs == [] and a.status is SequenceStatus.WAITING
    assert bm.num_free_blocks == 2


def test_prefill_only_chunks_are_whole_blocks_and_the_last_at_most_one_block():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=7)
    a = make_seq(18, "a", prefill_only=True)
    sched.add(a)
    sizes = []
    while a.num_output_tokens == 0:
        batch = sched.schedule()
        sizes.append(batch.num_new_tokens[0])
        run(sched, batch)
    # the final chunk's write cannot hide behind compute, so it is cut to one block or less
    assert sizes == [4, 4, 4, 4, 2]


def test_prefill_only_sequences_are_never_preempted():
    bm = BlockManager(5, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(8, "a")
    p = make_seq(12, "p", prefill_only=True, start=100)
    sched.add(a)
    sched.add(p)
    batch = sched.schedule()
    assert batch.num_new_tokens == [8, 12]
    a.num_computed_tokens = 8
    a.token_ids.append(1)
    p.num_computed_tokens = 8  # pretend p is mid-prefill (not its last chunk)
    batch = sched.schedule()  # a needs a 3rd block, none free; p may not be the victim
    assert a.status is SequenceStatus.WAITING
    assert batch.seqs == [p] and p.block_table


def test_waiting_not_admitted_in_a_step_that_preempted():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    c = make_seq(1, "c", start=200)
    sched.add(c)
    batch = sched.schedule()
    assert c not in batch.seqs and c.status is SequenceStatus.WAITING


def test_decodes_are_scheduled_before_an_earlier_admitted_prefill():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=4)
    long, short = make_seq(40, "long"), make_seq(2, "short", start=100)
    sched.add(short)
    sched.add(long)
    run(sched, sched.schedule())  # short prefills (2), long gets 2
    sched.running.reverse()  # long is now ahead of short in admission order
    batch = sched.schedule()
    assert batch.seqs == [short, long] and batch.num_new_tokens == [1, 3]


def test_prefilled_sequence_waits_for_a_free_seat_then_decodes():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=16)
    a = make_seq(3, "a")
    sched.add(a)
    run(sched, sched.schedule())
    p = make_seq(8, "p", start=100)
    p.block_table = bm.allocate_blocks(2)
    p.num_computed_tokens = 8
    p.token_ids.append(5)  # the first token, sampled by the prefill worker
    sched.add_prefilled(p)
    batch = sched.schedule()
    assert batch.seqs == [a] and p.status is SequenceStatus.WAITING
    sched.remove(a)
    bm.deallocate(a)
    batch = sched.schedule()
    assert batch.seqs == [p] and batch.num_new_tokens == [1] and len(p.block_table) == 3


def test_single_chunk_prefill_only_prompt_is_not_split():
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=64)
    a = make_seq(18, "a", prefill_only=True)
    sched.add(a)
    assert sched.schedule().num_new_tokens == [18]


def _seq_with_max_tokens(n: int, rid: str, max_tokens: int, start: int = 0) -> Sequence:
    params = SamplingOptions(temperature=0, max_tokens=max_tokens)
    return Sequence(rid, list(range(start, start + n)), params)


def test_output_room_keeps_a_second_sequence_waiting_instead_of_preempting_later():
    # 6 blocks of 4: a (8 tokens, 8 out) needs 2 + 2 blocks; b the same: both cannot fit
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, reserve_output_tokens=64)
    a = _seq_with_max_tokens(8, "a", max_tokens=8)
    b = _seq_with_max_tokens(8, "b", max_tokens=8, start=50)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a] and list(sched.waiting) == [b]
    assert sched.num_promised_blocks() == 2
    while not a.is_finished and a.num_output_tokens < 8:
        run(sched, sched.schedule())
    assert sched.num_preemptions == 0


def test_output_room_is_capped_by_reserve_output_tokens():
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, reserve_output_tokens=4)
    a = _seq_with_max_tokens(8, "a", max_tokens=1000)
    b = _seq_with_max_tokens(4, "b", max_tokens=1000, start=50)
    sched.add(a)
    sched.add(b)
    # a: 2 blocks + 1 of room; b: 1 block + 1 of room -> 5 of 6
    assert sched.schedule().seqs == [a, b]
    assert sched.num_promised_blocks() == 2


def test_without_output_room_both_are_admitted_as_before():
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a = _seq_with_max_tokens(8, "a", max_tokens=8)
    b = _seq_with_max_tokens(8, "b", max_tokens=8, start=50)
    sched.add(a)
    sched.add(b)
    assert sched.schedule().seqs == [a, b] and sched.num_promised_blocks() == 0


def test_preempted_lists_the_sequences_the_last_schedule_preempted():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    assert sched.preempted == []
    run(sched, sched.schedule())  # a needs a third block: b is preempted
    assert sched.preempted == [b]
    sched.schedule()
    assert sched.preempted == []  # only the last schedule's


def test_held_sequence_and_those_behind_it_wait_until_unheld():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(5, "a"), make_seq(5, "b", start=50)
    sched.add(a)
    sched.add(b)
    sched.hold(a)
    assert sched.schedule().seqs == [] and list(sched.waiting) == [a, b]
    sched.unhold("a")
    assert sched.schedule().seqs == [a, b]


def test_removing_a_held_sequence_forgets_its_hold():
    sched = Scheduler(BlockManager(16, BS), max_num_seqs=8, max_num_batched_tokens=100)
    a = make_seq(5, "a")
    sched.add(a)
    sched.hold(a)
    sched.remove(a)
    assert not sched.is_held("a")


def test_fits_agrees_with_admission_of_the_head():
    bm = BlockManager(4, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b = make_seq(8, "a"), make_seq(9, "b", start=50)
    sched.add(a)
    sched.add(b)
    assert sched.fits(a)
    run(sched, sched.schedule())  # a takes 3 blocks (9 tokens now); b needs 3, 1 is free
    assert not sched.fits(b) and list(sched.waiting) == [b]
    sched.remove(a)
    bm.deallocate(a)
    assert sched.fits(b)
    assert sched.schedule().seqs == [b]


def test_fits_keeps_the_output_room_owed_to_running_sequences():
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, reserve_output_tokens=8)
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched.add(a)
    run(sched, sched.schedule())  # a: 1 block + 2 owed for its output room; 5 free
    sched.add(b)
    assert sched.fits(b)  # 1 + 2 for b, 2 owed to a: 5
    bm.allocate_blocks(1)
    assert not sched.fits(b)
    assert sched.schedule().seqs == [a]  # a decodes; b is not admitted
