"""The decode worker's side of speculative decoding: DraftBook (pure) and a DecodeWorker driven
with proposals from an in-test drafter (no NATS): output as without drafts, whatever they say."""

from __future__ import annotations

import random

import pytest
from kvmesh.services.decode.drafts import DraftBook, Outgoing, rebase_tree
from kvmesh.shared.bus.messages.drafts import DraftProposal
from kvmesh.shared.bus.messages.placement import ReserveRequest
from kvmesh.shared.text.sampling import SamplingOptions


def _seqs(**lengths: int) -> dict[str, tuple[list[int], int]]:
    return {rid: (list(range(n)), 2) for rid, n in lengths.items()}


def test_first_context_goes_whole_to_the_queue_group_then_deltas_to_the_pinned_worker():
    book = DraftBook("d0")
    [out] = book.contexts(_seqs(r=5), now=0.0)
    assert out.draft_worker_id is None and out.message.start == 0
    assert out.message.token_ids == (0, 1, 2, 3, 4) and out.message.num_prompt_tokens == 2
    assert book.contexts(_seqs(r=5), now=0.1) == []  # nothing new: nothing sent
    book.on_proposal(DraftProposal("r", "x1", 5, (7,), (-1,)), now=0.2)
    [out] = book.contexts(_seqs(r=7), now=0.3)
    assert out.draft_worker_id == "x1" and out.message.start == 5
    assert out.message.token_ids == (5, 6)


def test_sequence_pinned_at_admission_sends_its_first_context_whole_to_that_worker():
    book = DraftBook("d0", unpin_after_s=2.0)
    book.pin("r", "x1", now=0.0)  # the prefill wrote the prompt's draft KV into x1
    [out] = book.contexts(_seqs(r=5), now=0.1)
    assert out.draft_worker_id == "x1" and out.message.start == 0
    assert out.message.token_ids == (0, 1, 2, 3, 4)
    book.on_proposal(DraftProposal("r", "x1", 5, (7,), (-1,)), now=0.2)
    [out] = book.contexts(_seqs(r=6), now=0.3)
    assert out.draft_worker_id == "x1" and out.message.start == 5
    book.pin("q", "x2", now=0.0)  # x2 never answers: let go, the queue group gets it whole
    [out] = book.contexts(_seqs(q=5), now=2.5)
    assert out.draft_worker_id is None and out.message.start == 0


def test_unpinned_sequence_sends_its_whole_context_again_until_a_worker_answers():
    book = DraftBook("d0")
    book.contexts(_seqs(r=5), now=0.0)
    [out] = book.contexts(_seqs(r=6), now=0.1)
    assert (
        out.draft_worker_id is None and out.message.start == 0 and len(out.message.token_ids) == 6
    )


ROOM = 100  # tokens a sequence may still emit, less one: no cut


def test_only_a_proposal_that_continues_the_sequence_is_handed_out():
    book = DraftBook("d0")
    book.contexts(_seqs(r=5), now=0.0)
    book.on_proposal(DraftProposal("r", "x1", 5, (7, 8), (-1, 0)), now=0.1)
    seq = [0, 1, 2, 3, 4, 9]
    assert book.drafts({"r": (seq, ROOM)}) == {}  # stale: the sequence went elsewhere
    book.on_proposal(DraftProposal("r", "x1", 6, (7, 8), (-1, 0)), now=0.1)
    assert book.drafts({"r": (seq, ROOM)}) == {"r": ((7, 8), (-1, 0))}
    assert book.drafts({"r": ([*seq, 5], ROOM)}) == {}  # rejected: dropped for good
    assert book.drafts({"r": (seq, ROOM)}) == {}


def test_proposal_stays_for_the_next_steps_while_the_sequence_follows_it():
    book = DraftBook("d0")
    book.contexts(_seqs(r=2), now=0.0)
    chain = tuple(range(10, 20))
    book.on_proposal(DraftProposal("r", "x1", 2, chain, tuple(range(-1, 9)), depth=3), now=0.1)
    seq = [0, 1]
    assert book.drafts({"r": (seq, ROOM)}) == {"r": ((10, 11, 12), (-1, 0, 1))}
    seq += [10, 11, 12, 13]  # every draft accepted, and the next token as the drafter guessed
    assert book.drafts({"r": (seq, ROOM)}) == {"r": ((14, 15, 16), (-1, 0, 1))}
    seq += [14, 15, 16, 17, 18, 19]  # past its deepest node: used up
    assert book.drafts({"r": (seq, ROOM)}) == {}
    assert book.links["r"].proposal is None


def test_drafts_are_cut_to_the_tokens_the_sequence_may_still_emit():
    book = DraftBook("d0")
    book.contexts(_seqs(r=2), now=0.0)
    book.on_proposal(DraftProposal("r", "x1", 2, (5, 6, 7), (-1, 0, 0)), now=0.1)
    assert book.drafts({"r": ([0, 1], 1)}) == {"r": ((5,), (-1,))}
    assert book.drafts({"r": ([0, 1], 0)}) == {}  # one token left: nothing worth verifying
    assert book.drafts({"r": ([0, 1], 2)}) == {"r": ((5, 6, 7), (-1, 0, 0))}  # kept meanwhile


def test_proposal_a_step_late_gives_the_subtree_below_the_token_that_step_added():
    book = DraftBook("d0")
    book.contexts(_seqs(r=5), now=0.0)
    # 7 -> (8 -> 9 | 6), cut to depth 1 below the new root
    book.on_proposal(DraftProposal("r", "x1", 5, (7, 8, 6, 9), (-1, 0, 0, 1), depth=1), now=0.1)
    assert book.drafts({"r": ([0, 1, 2, 3, 4, 7], ROOM)}) == {"r": ((8, 6), (-1, -1))}


def test_rebase_tree_follows_the_added_tokens_and_cuts_to_the_depth():
    tokens, parents = (1, 2, 3, 4, 5), (-1, -1, 0, 2, 1)  # 1 -> 3 -> 4 ; 2 -> 5
    assert rebase_tree(tokens, parents, ()) == (tokens, parents)
    assert rebase_tree(tokens, parents, (), max_depth=1) == ((1, 2), (-1, -1))
    assert rebase_tree(tokens, parents, (1,)) == ((3, 4), (-1, 0))
    assert rebase_tree(tokens, parents, (1, 3, 4)) == ((), ())
    assert rebase_tree(tokens, parents, (2, 5)) == ((), ())
    assert rebase_tree(tokens, parents, (3,)) is None  # not a child of the root
    assert rebase_tree(tokens, parents, (1, 3, 4, 6)) is None


def test_need_context_from_the_pinned_worker_sends_the_whole_context_again():
    book = DraftBook("d0")
    book.contexts(_seqs(r=5), now=0.0)
    book.on_proposal(DraftProposal("r", "x1", 5, (), ()), now=0.1)
    book.on_proposal(DraftProposal("r", "x1", 6, need_context=True), now=0.2)
    [out] = book.contexts(_seqs(r=6), now=0.3)
    assert out.draft_worker_id is None and out.message.start == 0


def test_silent_pinned_worker_is_let_go_after_the_timeout():
    book = DraftBook("d0", unpin_after_s=1.0)
    book.contexts(_seqs(r=5), now=0.0)
    book.on_proposal(DraftProposal("r", "x1", 5, (), ()), now=0.1)
    [out] = book.contexts(_seqs(r=6), now=0.5)
    assert out.draft_worker_id == "x1"
    [out] = book.contexts(_seqs(r=7), now=2.0)
    assert out.draft_worker_id is None and out.message.start == 0


def test_gone_worker_loses_its_sequences_and_forget_names_the_holder():
    book = DraftBook("d0")
    book.contexts(_seqs(a=3, b=3), now=0.0)
    book.on_proposal(DraftProposal("a", "x1", 3, (), ()), now=0.0)
    book.on_proposal(DraftProposal("b", "x2", 3, (), ()), now=0.0)
    book.on_worker_gone("x1")
    outs = {o.message.request_id: o for o in book.contexts(_seqs(a=4, b=4), now=0.1)}
    assert outs["a"].draft_worker_id is None and outs["b"].draft_worker_id == "x2"
    assert book.forget("b") == "x2" and book.forget("b") is None


def test_acceptance_is_reported_with_the_next_context_and_latency_measured():
    book = DraftBook("d0")
    book.contexts(_seqs(r=5), now=1.0)
    assert book.on_proposal(DraftProposal("r", "x1", 5, (1,), (-1,)), now=1.25) == 0.25
    book.on_verified("r", 4, 3)
    [out] = book.contexts(_seqs(r=9), now=2.0)
    assert (out.message.num_verified, out.message.num_accepted) == (4, 3)
    [out] = book.contexts(_seqs(r=10), now=2.1)
    assert (out.message.num_verified, out.message.num_accepted) == (0, 0)


# --- a DecodeWorker with drafts ----------------------------------------------------------------

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(20 + 5 * i)] for i in range(4)]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def reference(tiny) -> list[list[int]]:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=128))
    return engine.generate(PROMPTS, SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))


async def _run(tiny, drafter) -> tuple[dict[str, list[int]], object]:
    """Local-prefill requests on a colocated worker with a DraftBook; between steps the
    ``drafter(rid, context)`` answers every context the worker sent."""
    from kvmesh.services.decode.metrics import DecodeMetrics
    from kvmesh.services.decode.speculation import Speculation
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=128))
    metrics = DecodeMetrics()
    speculation = Speculation(DraftBook("d0"), metrics, clock=lambda: 0.0)
    worker = DecodeWorker(
        engine,
        worker_id="d0",
        base_addr=engine.kv_pool.base_addr,
        colocated=True,
        metrics=metrics,
        clock=lambda: 0.0,
        hooks=[speculation],
    )
    opts = SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, prompt in enumerate(PROMPTS):
        reply = await worker.reserve(
            ReserveRequest(f"r{i}", tuple(prompt), opts, True, f"L{i}", 1000)
        )
        assert reply.ok
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    held: dict[str, list[int]] = {}
    for _ in range(1000):
        if worker.is_idle:
            break
        for event in await worker.admit() + await worker.step():
            got[event.request_id] += event.token_ids
        for item in speculation.take_messages():
            if not isinstance(item, Outgoing):
                continue
            msg = item.message
            held[msg.request_id] = held.get(msg.request_id, [])[: msg.start] + list(msg.token_ids)
            tokens = drafter(msg.request_id, held[msg.request_id])
            speculation.on_proposal(
                DraftProposal(
                    msg.request_id,
                    "x1",
                    len(held[msg.request_id]),
                    tuple(tokens),
                    tuple(range(-1, len(tokens) - 1)),
                )
            )
    assert worker.is_idle
    return got, worker.metrics


async def test_worker_with_perfect_drafts_emits_the_plain_output_in_fewer_steps(tiny, reference):
    def oracle(rid: str, context: list[int]) -> list[int]:
        i = int(rid[1:])
        done = len(context) - len(PROMPTS[i])
        return reference[i][done : done + 4]

    got, metrics = await _run(tiny, oracle)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
    accepted = metrics.spec_accepted_tokens._value.get()
    assert accepted > 0.8 * metrics.spec_draft_tokens._value.get() > 0


async def test_worker_with_wrong_drafts_still_emits_the_plain_output(tiny, reference):
    rng = random.Random(3)
    got, metrics = await _run(tiny, lambda rid, ctx: [rng.randrange(3, 250) for _ in range(3)])
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == reference
    assert metrics.spec_draft_tokens._value.get() > 0
