"""DraftCore: contexts whole and in deltas, resyncs, stale drafts, the LRU bound, acceptance,
pipelined chains (and the engine drafter topping one up)."""

from __future__ import annotations

from kvmesh.services.draft.core import DraftCore
from kvmesh.shared.bus.messages.drafts import DraftContext


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


def _chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def test_pipelined_chain_is_topped_up_while_the_sequence_follows_it():
    core = DraftCore("draft-0", max_sequences=8, depth=2, pipeline_depth=5)
    core.on_context(ctx("r", 0, [1, 2, 3]))
    [job] = core.take_jobs(4)
    assert job.ahead == ()
    first = core.proposal(job, (10, 11, 12, 13, 14), _chain(5))
    assert first is not None and first.position == 3 and first.depth == 2
    core.on_context(ctx("r", 3, [10, 11, 12]))  # 2 drafts accepted, the next token as guessed
    [job] = core.take_jobs(4)
    assert job.context == (1, 2, 3, 10, 11, 12) and job.ahead == (13, 14)
    topped = core.proposal(job, (15, 16, 17), _chain(3))  # only 3 new tokens were drafted
    assert topped is not None and topped.position == 6
    assert topped.tokens == (13, 14, 15, 16, 17) and topped.parents == _chain(5)
    core.on_context(ctx("r", 6, [13, 99]))  # a miss: the chain is discarded
    [job] = core.take_jobs(4)
    assert job.ahead == () and job.position == 8


def test_unpipelined_core_drafts_every_change_anew():
    core = DraftCore("draft-0", max_sequences=8, depth=2)
    core.on_context(ctx("r", 0, [1, 2, 3]))
    [job] = core.take_jobs(4)
    core.proposal(job, (10, 11, 12, 13), _chain(4))
    core.on_context(ctx("r", 3, [10, 11]))
    [job] = core.take_jobs(4)
    assert job.ahead == () and job.context == (1, 2, 3, 10, 11)


def test_engine_drafter_tops_up_a_chain_with_the_tokens_it_would_have_drafted(tiny):
    from kvmesh.services.draft.core import DraftSnapshot
    from kvmesh.services.draft.drafters import EngineDrafter
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    config = EngineConfig(num_blocks=64, block_size=8, enable_prefix_caching=True)
    drafter = EngineDrafter(LLMEngine(*tiny, config), depth=6)
    context = tuple((5 * i + 3) % 250 for i in range(21))
    [(whole, parents)] = drafter.propose([DraftSnapshot("r", "d", context, 21)])
    assert len(whole) == 6 and parents == _chain(6)
    [(rest, _)] = drafter.propose([DraftSnapshot("r", "d", context, 21, ahead=whole[:4])])
    assert rest == whole[4:]  # only the 2 tokens the chain lacked


def test_a_context_that_comes_after_its_sequence_ended_is_dropped():
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("r", 0, [1, 2]))
    assert core.forget("r")  # aborted (or finished) while a delta was on its way
    assert core.on_context(ctx("r", 2, [3])) is None  # no resync for what ended
    assert core.on_context(ctx("r", 0, [1, 2, 3])) is None
    assert "r" not in core.seqs and core.take_jobs(4) == [] and core.num_resyncs == 0


def test_a_dead_decode_workers_sequences_are_dropped():
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("a", 0, [1, 2]))
    core.on_context(DraftContext("b", "decode-1", 0, (1, 2)))
    assert core.forget_worker("decode-0") == 1
    assert list(core.seqs) == ["b"]
    assert core.on_context(ctx("a", 2, [3])) is None and "a" not in core.seqs


def test_a_resync_is_not_an_end():
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("r", 0, [1, 2]))
    assert core.on_context(ctx("r", 5, [9])).need_context  # a gap: dropped, asked for again
    assert core.on_context(ctx("r", 0, [1, 2, 3, 4, 5, 9])) is None
    assert "r" in core.seqs


def test_contexts_no_update_reached_for_idle_s_are_dropped_and_sent_again_whole_if_they_resume():
    """A DraftForget lost in a NATS outage leaves a context nobody updates: dropped after
    idle_s; a sequence that was only paused is answered need_context at its next delta."""
    core = DraftCore("draft-0", max_sequences=8)
    core.on_context(ctx("lost", 0, [1, 2]), now=10.0)
    core.on_context(ctx("live", 0, [3, 4]), now=10.0)
    core.on_context(ctx("live", 2, [5]), now=14.0)
    assert core.drop_idle(now=14.9, idle_s=5.0) == 0
    assert core.drop_idle(now=15.0, idle_s=5.0) == 1
    assert list(core.seqs) == ["live"] and core.stats()["idle_dropped"] == 1
    answer = core.on_context(ctx("lost", 2, [6]), now=16.0)  # it was only paused: resync
    assert answer is not None and answer.need_context
    assert core.on_context(ctx("lost", 0, [1, 2, 6]), now=16.5) is None
    assert core.drop_idle(now=19.0, idle_s=5.0) == 1  # "live": last update at 14.0
    assert list(core.seqs) == ["lost"]
