"""DraftCore: contexts whole and in deltas, resyncs, stale drafts, the LRU bound, acceptance."""

from __future__ import annotations

from kvmesh.services.draft.core import DraftCore
from kvmesh.shared.protocol import DraftContext


def ctx(rid: str, start: int, tokens, **kw) -> DraftContext:
    return DraftContext(rid, "decode-0", start, tuple(tokens), **kw)


def test_deltas_extend_the_context_and_each_change_is_drafted_once():
    core = DraftCore("draft-0", max_sequences=8)
    assert core.on_context(ctx("r", 0, [1, 2, 3], num_prompt_tokens=2)) is None
    [job] = core.take_jobs(4)
    assert job.context == (1, 2, 3) and job.position == 3 and job.num_prompt_tokens == 2
    assert core.take_jobs(4) == []  # nothing changed since
    assert core.on_context(ctx("r", 3, [4, 5])) is None
    [job] = core.take_jobs(4)
    assert job.context == (1, 2, 3, 4, 5)


def test_delta_for_an_unknown_sequence_asks_for_the_whole_context():
    core = DraftCore("draft-0", max_sequences=8)
    answer = core.on_context(ctx("r", 7, [1]))
    assert answer is not None and answer.need_context and answer.request_id == "r"
    assert answer.position == 8 and answer.draft_worker_id == "draft-0"
    assert core.take_jobs(4) == [] and core.num_resyncs == 1


def test_delta_with_a_gap_drops_the_sequence_and_asks_again():
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("r", 0, [1, 2]))
    answer = core.on_context(ctx("r", 5, [9]))
    assert answer is not None and answer.need_context
    assert "r" not in core.seqs


def test_proposal_is_dropped_only_when_the_context_grew_past_it_while_drafting():
    core = DraftCore("draft-0", max_sequences=8, depth=1)
    core.on_context(ctx("r", 0, [1, 2]))
    [job] = core.take_jobs(4)
    core.on_context(ctx("r", 2, [3]))
    late = core.proposal(job, (3, 4), (-1, 0))  # decode may still use 4, below the new 3
    assert late is not None and late.position == 2 and late.depth == 1
    core.on_context(ctx("r", 3, [4, 5]))
    assert core.proposal(job, (3, 4), (-1, 0)) is None  # grew by 3 > the tree's 2 tokens
    [job] = core.take_jobs(4)  # drafted again from the new context
    proposal = core.proposal(job, (4, 5), (-1, 0))
    assert proposal is not None and proposal.position == 5 and proposal.tokens == (4, 5)
    empty = core.proposal(job, (), ())  # nothing to propose: still says the worker is alive
    assert empty is not None and empty.tokens == () and not empty.need_context


def test_forgotten_sequence_gets_no_proposal():
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("r", 0, [1, 2]))
    [job] = core.take_jobs(4)
    assert core.forget("r") and not core.forget("r")
    assert core.proposal(job, (3,), (-1,)) is None


def test_least_recently_updated_sequence_is_dropped_beyond_the_cap():
    core = DraftCore("draft-0", max_sequences=2)
    core.on_context(ctx("a", 0, [1]))
    core.on_context(ctx("b", 0, [2]))
    core.on_context(ctx("a", 1, [3]))  # a is now the most recent
    core.on_context(ctx("c", 0, [4]))
    assert set(core.seqs) == {"a", "c"} and core.num_evicted == 1


def test_take_jobs_respects_the_batch_limit_oldest_first():
    core = DraftCore("draft-0", max_sequences=8)
    for i in range(5):
        core.on_context(ctx(f"r{i}", 0, [i]))
    assert [j.request_id for j in core.take_jobs(3)] == ["r0", "r1", "r2"]
    assert [j.request_id for j in core.take_jobs(3)] == ["r3", "r4"]


def test_acceptance_figures_sum_what_decode_workers_report():
    core = DraftCore("draft-0", max_sequences=8)
    assert core.stats()["acceptance"] is None
    core.on_context(ctx("r", 0, [1, 2], num_verified=4, num_accepted=3))
    core.on_context(ctx("r", 2, [3], num_verified=4, num_accepted=1))
    stats = core.stats()
    assert stats["verified_tokens"] == 8 and stats["accepted_tokens"] == 4
    assert stats["acceptance"] == 0.5
