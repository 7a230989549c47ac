from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.scheduler import Scheduler
from kvmesh.shared.engine.sequence import Sequence, SequenceStatus
from kvmesh.shared.text.sampling import SamplingOptions

BS = 4


def make_seq(
    n: int, rid: str, prefill_only: bool = False, start: int = 0, max_tokens: int = 16
) -> Sequence:
    return Sequence(
        rid,
        list(range(start, start + n)),
        SamplingOptions(temperature=0, max_tokens=max_tokens),
        prefill_only=prefill_only,
    )


def scheduler(
    num_blocks: int, *seqs: Sequence, max_num_seqs: int = 8, max_batched: int = 100, **options
) -> tuple[Scheduler, BlockManager]:
    """A scheduler over ``num_blocks`` blocks of BS tokens, with ``seqs`` added in order."""
    bm = BlockManager(num_blocks, BS)
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, **options)
    for seq in seqs:
        sched.add(seq)
    return sched, bm


def run(sched: Scheduler, batch, sampled: int = 7) -> None:
    """Apply a step: mark tokens computed, append a token where the prompt is done."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(sampled)


def test_chunked_prefill_respects_token_budget():
    a = make_seq(25, "a")
    sched, _ = scheduler(64, a, max_batched=10)
    sizes = []
    while a.num_output_tokens == 0:
        batch = sched.schedule()
        assert batch.num_tokens <= 10
        sizes.append(batch.num_new_tokens[0])
        run(sched, batch)
    assert sizes == [10, 10, 5]


def test_decodes_come_first_and_prefill_fills_the_rest_of_the_budget():
    a, b = make_seq(3, "a"), make_seq(20, "b")
    sched, _ = scheduler(64, a, b, max_batched=8)
    run(sched, sched.schedule())  # a prefills (3), b gets the remaining 5
    assert a.num_output_tokens == 1 and b.num_computed_tokens == 5
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 7]


def test_max_num_seqs_limits_running_batch():
    seqs = [make_seq(3, str(i)) for i in range(3)]
    sched, _ = scheduler(64, *seqs, max_num_seqs=2)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and list(sched.waiting) == [seqs[2]]


def test_preemption_frees_latest_sequence_when_blocks_run_out():
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched, bm = scheduler(4, a, b)
    run(sched, sched.schedule())  # both prefilled: 4 blocks used, each has 9 tokens now
    assert bm.num_free_blocks == 0
    batch = sched.schedule()  # a needs a third block: b is preempted
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert sched.num_preemptions == 1
    bm.check_invariants()


def test_preempts_itself_when_nothing_else_can_go():
    a = make_seq(8, "a")
    sched, bm = scheduler(2, a)
    run(sched, sched.schedule())
    batch = sched.schedule()
    assert batch.seqs == [] and a.status is SequenceStatus.WAITING
    assert bm.num_free_blocks == 2


def test_prefill_only_chunks_are_whole_blocks_and_the_last_at_most_one_block():
    a = make_seq(18, "a", prefill_only=True)
    sched, _ = scheduler(64, a, max_batched=7)
    sizes = []
    while a.num_output_tokens == 0:
        batch = sched.schedule()
        sizes.append(batch.num_new_tokens[0])
        run(sched, batch)
    # the final chunk's write cannot hide behind compute, so it is cut to one block or less
    assert sizes == [4, 4, 4, 4, 2]


def test_prefill_only_sequences_are_never_preempted():
    a = make_seq(8, "a")
    p = make_seq(12, "p", prefill_only=True, start=100)
    sched, _ = scheduler(5, a, p)
    batch = sched.schedule()
    assert batch.num_new_tokens == [8, 12]
    a.num_computed_tokens = 8
    a.token_ids.append(1)
    p.num_computed_tokens = 8  # pretend p is mid-prefill (not its last chunk)
    batch = sched.schedule()  # a needs a 3rd block, none free; p may not be the victim
    assert a.status is SequenceStatus.WAITING
    assert batch.seqs == [p] and p.block_table


def test_waiting_not_admitted_in_a_step_that_preempted():
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched, _ = scheduler(4, a, b)
    run(sched, sched.schedule())
    c = make_seq(1, "c", start=200)
    sched.add(c)
    batch = sched.schedule()
    assert c not in batch.seqs and c.status is SequenceStatus.WAITING


def test_decodes_are_scheduled_before_an_earlier_admitted_prefill():
    long, short = make_seq(40, "long"), make_seq(2, "short", start=100)
    sched, _ = scheduler(64, short, long, max_batched=4)
    run(sched, sched.schedule())  # short prefills (2), long gets 2
    sched.running.reverse()  # long is now ahead of short in admission order
    batch = sched.schedule()
    assert batch.seqs == [short, long] and batch.num_new_tokens == [1, 3]


def test_prefilled_sequence_waits_for_a_free_seat_then_decodes():
    a = make_seq(3, "a")
    sched, bm = scheduler(16, a, max_num_seqs=1, max_batched=16)
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
    a = make_seq(18, "a", prefill_only=True)
    sched, _ = scheduler(64, a, max_batched=64)
    assert sched.schedule().num_new_tokens == [18]


def test_output_room_keeps_a_second_sequence_waiting_instead_of_preempting_later():
    # 6 blocks of 4: a (8 tokens, 8 out) needs 2 + 2 blocks; b the same: both cannot fit
    a = make_seq(8, "a", max_tokens=8)
    b = make_seq(8, "b", max_tokens=8, start=50)
    sched, _ = scheduler(6, a, b, reserve_output_tokens=64)
    batch = sched.schedule()
    assert batch.seqs == [a] and list(sched.waiting) == [b]
    assert sched.num_promised_blocks() == 2
    while not a.is_finished and a.num_output_tokens < 8:
        run(sched, sched.schedule())
    assert sched.num_preemptions == 0


def test_output_room_is_capped_by_reserve_output_tokens():
    a = make_seq(8, "a", max_tokens=1000)
    b = make_seq(4, "b", max_tokens=1000, start=50)
    sched, _ = scheduler(6, a, b, reserve_output_tokens=4)
    # a: 2 blocks + 1 of room; b: 1 block + 1 of room -> 5 of 6
    assert sched.schedule().seqs == [a, b]
    assert sched.num_promised_blocks() == 2


def test_without_output_room_both_are_admitted_as_before():
    a = make_seq(8, "a", max_tokens=8)
    b = make_seq(8, "b", max_tokens=8, start=50)
    sched, _ = scheduler(6, a, b)
    assert sched.schedule().seqs == [a, b] and sched.num_promised_blocks() == 0


def test_preempted_lists_the_sequences_the_last_schedule_preempted():
    a, b = make_seq(8, "a"), make_seq(8, "b", start=50)
    sched, _ = scheduler(4, a, b)
    run(sched, sched.schedule())
    assert sched.preempted == []
    run(sched, sched.schedule())  # a needs a third block: b is preempted
    assert sched.preempted == [b]
    sched.schedule()
    assert sched.preempted == []  # only the last schedule's


def test_held_sequence_and_those_behind_it_wait_until_unheld():
    a, b = make_seq(5, "a"), make_seq(5, "b", start=50)
    sched, _ = scheduler(16, a, b)
    sched.hold(a)
    assert sched.schedule().seqs == [] and list(sched.waiting) == [a, b]
    sched.unhold("a")
    assert sched.schedule().seqs == [a, b]


def test_removing_a_held_sequence_forgets_its_hold():
    a = make_seq(5, "a")
    sched, _ = scheduler(16, a)
    sched.hold(a)
    sched.remove(a)
    assert not sched.is_held("a")


def test_fits_agrees_with_admission_of_the_head():
    a, b = make_seq(8, "a"), make_seq(9, "b", start=50)
    sched, bm = scheduler(4, a, b)
    assert sched.fits(a)
    run(sched, sched.schedule())  # a takes 3 blocks (9 tokens now); b needs 3, 1 is free
    assert not sched.fits(b) and list(sched.waiting) == [b]
    sched.remove(a)
    bm.deallocate(a)
    assert sched.fits(b)
    assert sched.schedule().seqs == [b]


def test_fits_keeps_the_output_room_owed_to_running_sequences():
    a, b = make_seq(4, "a"), make_seq(4, "b", start=50)
    sched, bm = scheduler(6, a, reserve_output_tokens=8)
    run(sched, sched.schedule())  # a: 1 block + 2 owed for its output room; 5 free
    sched.add(b)
    assert sched.fits(b)  # 1 + 2 for b, 2 owed to a: 5
    bm.allocate_blocks(1)
    assert not sched.fits(b)
    assert sched.schedule().seqs == [a]  # a decodes; b is not admitted


def test_prefill_is_first_come_first_served_the_oldest_takes_the_whole_budget():
    a, b, c = make_seq(25, "a"), make_seq(25, "b", start=100), make_seq(25, "c", start=200)
    sched, _ = scheduler(64, a, b, c, max_batched=10)
    steps = 0
    while a.num_output_tokens == 0:
        batch = sched.schedule()
        run(sched, batch)
        steps += 1
        if steps < 3:
            assert batch.seqs == [a] and b.num_computed_tokens == c.num_computed_tokens == 0
    assert steps == 3  # ceil(25 / 10): not interleaved with b and c
    assert (b.num_computed_tokens, c.num_computed_tokens) == (5, 0)  # b rides the remainder
    while b.num_output_tokens == 0:
        run(sched, sched.schedule())
        steps += 1
    # a decodes one token a step from here, b takes the other 9: done in step 6, c rides along
    assert steps == 6 and c.num_computed_tokens == 10 - 1 - 2


def test_a_step_without_decodes_takes_the_no_decode_budget():
    a, b = make_seq(30, "a"), make_seq(60, "b", start=100)
    sched, _ = scheduler(64, a, b, max_batched=8, max_num_batched_tokens_no_decode=40)
    batch = sched.schedule()  # a's whole prompt, no more: b riding along would delay a
    assert batch.seqs == [a] and batch.num_new_tokens == [30]
    run(sched, batch)
    batch = sched.schedule()  # a decodes now: the budget is back to 8
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 7]
    sched.remove(a)
    run(sched, batch)
    assert sched.schedule().num_new_tokens == [40]  # b alone: capped at the no-decode budget


def test_the_no_decode_budget_never_applies_with_a_prefilled_sequence_waiting():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, 8, 8, max_num_batched_tokens_no_decode=40)
    sched.add(make_seq(30, "a"))
    done = make_seq(9, "d", start=100)
    bm.allocate(done)
    done.num_computed_tokens = 8
    sched.add_prefilled(done)
    batch = sched.schedule()
    assert batch.num_tokens == 8  # d admitted to decode, a's chunk within the budget
    prefill_only = make_seq(30, "p", prefill_only=True)
    sched2, _ = scheduler(64, prefill_only, max_batched=8, max_num_batched_tokens_no_decode=40)
    assert sched2.schedule().num_new_tokens == [8]  # hand-off chunks keep their size
