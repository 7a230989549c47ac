"""LLMEngine.step(drafts): draft trees verified in the batch step, token for token lossless."""

import random
from collections.abc import Callable

import pytest
import torch
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError, RequestOutput
from kvmesh.shared.text.sampling import SamplingOptions
from support.engine_runs import new_tokens, run_requests

NUM_BLOCKS = 64
GREEDY = SamplingOptions(max_tokens=20, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (13, 7, 30, 21)

# (request id, tokens emitted so far) -> tree or None
Drafter = Callable[[str, list[int]], DraftTree | None]


def make_engine(tiny, **kw) -> LLMEngine:
    model, tok = tiny
    kw.setdefault("num_blocks", NUM_BLOCKS)
    kw.setdefault("block_size", 8)
    return LLMEngine(model, tok, EngineConfig(**kw))


def make_prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(PROMPT_LENGTHS[i % 4])] for i in range(n)]


def run(
    eng: LLMEngine,
    prompts: list[list[int]],
    params: SamplingOptions | list[SamplingOptions],
    drafter: Drafter,
) -> tuple[list[list[int]], list[RequestOutput]]:
    """Run to completion with ``drafter`` asked before every step; returns the tokens of each
    request and every output (request by request)."""
    per_request = run_requests(eng, prompts, params, drafter)
    eng.block_manager.check_invariants()
    return [new_tokens(outs) for outs in per_request], [o for outs in per_request for o in outs]


def oracle(reference: list[list[int]], k: int) -> Drafter:
    """A chain of the next ``k`` tokens of the plain run: every draft is right."""

    def drafter(rid: str, done: list[int]) -> DraftTree | None:
        if not done:
            return None
        return DraftTree.chain(reference[int(rid[1:])][len(done) : len(done) + k])

    return drafter


def random_chain(k: int, seed: int = 1) -> Drafter:
    rng = random.Random(seed)
    return lambda rid, done: DraftTree.chain([rng.randrange(256) for _ in range(k)])


def hidden_path_tree(reference: list[list[int]], seed: int = 2) -> Drafter:
    """Width 3 at depth 1 and 2 at depth 2: the right path hides under the second child, beside
    wrong siblings, with a wrong leaf after it."""
    rng = random.Random(seed)

    def drafter(rid: str, done: list[int]) -> DraftTree | None:
        nxt = reference[int(rid[1:])][len(done) : len(done) + 2]
        if not done or len(nxt) < 2:
            return None
        wrong = [(t + 1 + rng.randrange(255)) % 256 for t in (nxt[0], nxt[0], nxt[1], nxt[1])]
        tokens = (wrong[0], nxt[0], wrong[1], wrong[2], nxt[1], rng.randrange(256))
        return DraftTree(tokens, (-1, -1, -1, 1, 1, 4))

    return drafter


@pytest.fixture(scope="module")
def greedy_reference(tiny):
    prompts = make_prompts()
    return prompts, make_engine(tiny).generate(prompts, GREEDY)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_random_chain_drafts_equals_plain_greedy(tiny, greedy_reference, k):
    prompts, expected = greedy_reference
    got, _ = run(make_engine(tiny), prompts, GREEDY, random_chain(k))
    assert got == expected


@pytest.mark.parametrize("k", [1, 4])
def test_correct_chain_drafts_emit_k_plus_one_tokens_per_step(tiny, greedy_reference, k):
    prompts, expected = greedy_reference
    eng = make_engine(tiny)
    got, outputs = run(eng, prompts, GREEDY, oracle(expected, k))
    assert got == expected
    verified = [o for o in outputs if o.accepted_drafts or len(o.new_token_ids) > 1]
    assert verified
    for out in verified:
        if not out.finished:
            assert out.accepted_drafts == k and len(out.new_token_ids) == k + 1
    totals = eng.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0


def test_greedy_with_trees_equals_plain_greedy_and_finds_the_hidden_path(tiny, greedy_reference):
    prompts, expected = greedy_reference
    eng = make_engine(tiny)
    got, outputs = run(eng, prompts, GREEDY, hidden_path_tree(expected))
    assert got == expected
    assert any(o.accepted_drafts == 2 for o in outputs)


def test_mixed_drafted_and_plain_sequences_in_one_batch_equal_plain_greedy(tiny, greedy_reference):
    prompts, expected = greedy_reference
    right = oracle(expected, 3)
    wrong = random_chain(2)
    tree = hidden_path_tree(expected)

    def drafter(rid: str, done: list[int]) -> DraftTree | None:
        return {"r0": right, "r1": wrong, "r2": tree}.get(rid, lambda *_: None)(rid, done)

    eng = make_engine(tiny)
    got, _ = run(eng, prompts, GREEDY, drafter)
    assert got == expected
    assert eng.spec_totals.num_verify_steps > 0


def test_kv_after_accepting_drafts_equals_kv_of_a_plain_run(tiny, greedy_reference):
    prompts, expected = greedy_reference
    prompt, ref = prompts[2], expected[2]
    params = SamplingOptions(max_tokens=100, temperature=0.0, ignore_eos=True)
    spec, plain = make_engine(tiny), make_engine(tiny)
    spec.add_request("r", prompt, params)
    plain.add_request("r", prompt, params)
    spec.step()
    tree = DraftTree((ref[1] ^ 1, ref[1], ref[2], ref[3] ^ 1, ref[3]), (-1, -1, 1, 1, 2))
    (out,) = spec.step({"r": tree})
    assert out.new_token_ids == ref[1:5] and out.accepted_drafts == 3
    for _ in range(5):
        plain.step()
    seq_s, seq_p = spec.seqs["r"], plain.seqs["r"]
    assert seq_s.token_ids == seq_p.token_ids
    assert seq_s.num_computed_tokens == seq_p.num_computed_tokens == len(prompt) + 4
    n = seq_s.num_computed_tokens
    assert len(seq_s.block_table) == -(-n // 8)  # blocks past the kept path were freed
    for eng_s_layer in range(tiny[0].config.num_hidden_layers):
        for cache_s, cache_p in zip(
            spec.kv_pool.layer(eng_s_layer), plain.kv_pool.layer(eng_s_layer), strict=True
        ):
            kv_s = cache_s[seq_s.block_table].flatten(0, 1)[:n]
            kv_p = cache_p[seq_p.block_table].flatten(0, 1)[:n]
            torch.testing.assert_close(kv_s, kv_p, rtol=1e-5, atol=1e-5)
    assert spec.step()[0].new_token_ids == plain.step()[0].new_token_ids


def assert_same_sequence_and_kv(spec, plain, num_layers: int, rid: str = "r") -> None:
    """Request ``rid`` has the same tokens in both engines, the same number computed, and the
    same KV bytes for every computed token in every layer."""
    seq_s, seq_p = spec.seqs[rid], plain.seqs[rid]
    assert seq_s.token_ids == seq_p.token_ids
    n = seq_s.num_computed_tokens
    assert n == seq_p.num_computed_tokens
    for layer in range(num_layers):
        caches = zip(spec.kv_pool.layer(layer), plain.kv_pool.layer(layer), strict=True)
        for cache_s, cache_p in caches:
            kv_s = cache_s[seq_s.block_table].flatten(0, 1)[:n]
            assert torch.equal(kv_s, cache_p[seq_p.block_table].flatten(0, 1)[:n])


@pytest.mark.parametrize("threads", [1, 3])
def test_chain_verification_equals_plain_decode_bit_for_bit(tiny, greedy_reference, threads):
    # A chain verifies as a decode batch of one row per draft (the fused C layer, its rows
    # reading each other's new K/V): tokens and every KV byte as plain decode steps give them,
    # also when the rows of one chain fall to different threads.
    prompts, expected = greedy_reference
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spec, plain = make_engine(tiny), make_engine(tiny)
        params = SamplingOptions(max_tokens=len(expected[2]), temperature=0.0, ignore_eos=True)
        for eng in (spec, plain):
            eng.add_request("r", prompts[2], params)
        got = spec.step()[0].new_token_ids
        while len(got) < len(expected[2]) - 5:
            (out,) = spec.step({"r": DraftTree.chain(expected[2][len(got) : len(got) + 4])})
            assert out.accepted_drafts == 4
            got += out.new_token_ids
        for _ in got:
            plain.step()
    finally:
        torch.set_num_threads(saved)
    assert got == expected[2][: len(got)]
    assert_same_sequence_and_kv(spec, plain, tiny[0].config.num_hidden_layers)


@pytest.mark.parametrize("threads", [1, 3])
def test_tree_verification_equals_plain_decode_bit_for_bit(tiny, greedy_reference, threads):
    # On the C decode kernels a tree verifies as one row per node, each reading its
    # ancestors' slots (TreeRows): the kept path's tokens and every KV byte are what plain
    # decode steps give, the right path hidden under wrong siblings at every depth.
    prompts, expected = greedy_reference
    ref = expected[2]
    rng = random.Random(5)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    spec, plain = make_engine(tiny), make_engine(tiny)
    prepare = spec.runner.prepare
    rows_seen = []

    def spy(*args, **kwargs):
        out = prepare(*args, **kwargs)
        rows_seen.append(out[2].tree_rows is not None)
        return out

    spec.runner.prepare = spy
    try:
        params = SamplingOptions(max_tokens=len(ref), temperature=0.0, ignore_eos=True)
        for eng in (spec, plain):
            eng.add_request("r", prompts[2], params)
        got = spec.step()[0].new_token_ids
        while len(got) < len(ref) - 4:
            a, b, c = ref[len(got) : len(got) + 3]
            w = [(t + 1 + rng.randrange(255)) % 256 for t in (a, b, c, c)]
            # depth 1: a wrong sibling first; depth 2: the right node second; depth 3: two
            # wrong leaves under the wrong branch, the right one last
            tree = DraftTree((w[0], a, w[1], b, w[2], w[3], c), (-1, -1, 1, 1, 0, 3, 3))
            (out,) = spec.step({"r": tree})
            assert out.accepted_drafts == 3, (out, tree)
            got += out.new_token_ids
        for _ in got:
            plain.step()
    finally:
        torch.set_num_threads(saved)
    assert any(rows_seen)
    assert got == ref[: len(got)]
    assert_same_sequence_and_kv(spec, plain, tiny[0].config.num_hidden_layers)


def test_seeded_sampling_with_drafts_equals_seeded_sampling_without(tiny):
    prompts = make_prompts()
    params = [
        SamplingOptions(max_tokens=16, temperature=1.0, top_k=20, seed=11),
        SamplingOptions(max_tokens=16, temperature=0.7, top_p=0.9, seed=12),
        SamplingOptions(max_tokens=16, temperature=1.3, seed=13),
        GREEDY,
    ]
    expected = make_engine(tiny).generate(prompts, params)
    got, _ = run(make_engine(tiny), prompts, params, oracle(expected, 4))
    assert got == expected
    got, _ = run(make_engine(tiny), prompts, params, random_chain(3))
    assert got == expected


def test_stop_token_and_max_tokens_cut_inside_a_multi_token_step(tiny, greedy_reference):
    prompts, expected = greedy_reference
    ref = expected[0]
    stop_at = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingOptions(
        max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(ref[stop_at],)
    )
    short = SamplingOptions(max_tokens=3, temperature=0.0, ignore_eos=True)
    got, outputs = run(
        make_engine(tiny), [prompts[0], prompts[0]], [stop, short], oracle([ref, ref], 8)
    )
    assert got == [ref[: stop_at + 1], ref[:3]]
    finals = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finals == {"r0": "stop", "r1": "length"}


def test_stop_string_cuts_inside_a_multi_token_step(tiny, greedy_reference):
    prompts, expected = greedy_reference
    text_tokens = [(i, t) for i, t in enumerate(expected[2]) if 97 <= t <= 122 and i >= 2]
    assert text_tokens, "the reference output has no lowercase letter to stop at"
    at, token = text_tokens[0]
    params = SamplingOptions(max_tokens=20, temperature=0.0, ignore_eos=True, stop=(chr(token),))
    plain = make_engine(tiny).generate([prompts[2]], params)[0]
    got, outputs = run(make_engine(tiny), [prompts[2]], params, oracle([expected[2]], 6))
    assert got == [plain] and len(plain) <= at + 1
    assert outputs[-1].finish_reason == "stop"


def test_drafts_for_requests_not_decoding_are_ignored(tiny):
    eng = make_engine(tiny, max_num_batched_tokens=16)
    prompt = make_prompts(1)[0] * 3  # 39 tokens: three prefill chunks of 16
    eng.add_request("r", prompt, GREEDY)
    tree = DraftTree.chain([1, 2, 3])
    outs = eng.step({"r": tree, "nobody": tree})
    assert outs == []
    assert eng.last_spec_step.num_verified_seqs == 0
    assert eng.last_spec_step.num_ignored_trees == 2
    assert eng.seqs["r"].num_computed_tokens == 16 and len(eng.seqs["r"]) == len(prompt)
    plain = make_engine(tiny, max_num_batched_tokens=16).generate([prompt], GREEDY)[0]
    got = []
    while eng.has_unfinished():
        for out in eng.step({"r": tree}):
            got += out.new_token_ids
    assert got == plain
    assert eng.block_manager.num_free_blocks == NUM_BLOCKS


def test_spec_step_stats_count_proposed_accepted_and_time(tiny, greedy_reference):
    prompts, expected = greedy_reference
    eng = make_engine(tiny)
    eng.add_request("r", prompts[1], GREEDY)
    eng.step()
    ref = expected[1]
    tree = DraftTree((ref[1], ref[2], ref[2] ^ 7), (-1, 0, 0))
    (out,) = eng.step({"r": tree})
    stats = eng.last_spec_step
    assert (stats.num_verified_seqs, stats.num_draft_tokens, stats.num_draft_positions) == (1, 3, 2)
    assert stats.num_accepted_tokens == out.accepted_drafts == 2
    assert stats.verify_time_s > 0
    assert out.new_token_ids == ref[1:4]


def test_scored_tree_rolled_back_or_kept_leaves_greedy_output_as_it_was(tiny, greedy_reference):
    # score_trees (a drafter's tree expansion): the rows are the logits after the last token
    # and after each node's path; rolled back, or its right path kept, the output is unchanged
    prompts, expected = greedy_reference
    eng = make_engine(tiny)
    eng.add_request("r0", prompts[0], GREEDY)
    got = eng.step()[0].new_token_ids  # the prompt's token: decoding from here
    nxt = expected[0][1:4]
    tree = DraftTree((nxt[0] ^ 1, nxt[0], nxt[1], nxt[1] ^ 1), (-1, -1, 1, 1))
    rows = eng.score_trees({"r0": tree})["r0"]
    assert rows.shape[0] == len(tree) + 1
    assert rows[[0, 2, 3]].argmax(-1).tolist() == nxt  # after the last token, nxt[0], nxt[1]
    eng.rollback("r0", len(tree))
    got += eng.step()[0].new_token_ids  # plain, as if nothing had been scored
    nxt = expected[0][2:5]
    tree = DraftTree((nxt[0], nxt[1], nxt[0] ^ 1), (-1, 0, -1))
    rows = eng.score_trees({"r0": tree})["r0"]
    with pytest.raises(RequestError, match="not a path from the root"):
        eng.keep_path("r0", tree, (2, 1), int(rows[2].argmax()))
    with pytest.raises(RequestError, match="follows score_trees of the same tree"):
        eng.keep_path("r0", DraftTree.chain(nxt[:2]), (0, 1), int(rows[2].argmax()))
    out = eng.keep_path("r0", tree, (0, 1), int(rows[2].argmax()))
    assert out.new_token_ids == nxt  # the path and the token after it
    got += out.new_token_ids
    while eng.has_unfinished():
        got += [t for o in eng.step() for t in o.new_token_ids]
    assert got == expected[0]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    eng.block_manager.check_invariants()
