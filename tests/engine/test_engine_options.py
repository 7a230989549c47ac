"""Sampling options through the engine: logprobs and repetition penalty against transformers,
every option lossless under speculative verification and across a prefill hand-off."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import RequestError, RequestOutput
from kvmesh.shared.model import load_model
from kvmesh.shared.text.sampling import SamplingOptions
from support.engine_handoff import prefill_handoff
from support.engine_runs import run_requests
from support.hf_fixtures import load_hf_reference

EVERY_OPTION = SamplingOptions(
    max_tokens=14,
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    min_p=0.02,
    seed=7,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    logit_bias={3: 2.0, 9: -5.0},
    min_tokens=5,
    logprobs=3,
    ignore_eos=True,
)


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoints):
    return hf_checkpoints["llama"]


@pytest.fixture(scope="module")
def llama(checkpoint):
    return load_model(str(checkpoint))


def engine(model_tok, kv_buffer=None, **kw) -> LLMEngine:
    model, tok = model_tok
    kw.setdefault("num_blocks", 64)
    return LLMEngine(model, tok, EngineConfig(**kw), kv_buffer=kv_buffer)


def prompt(n: int = 37, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def logprobs(outs: list[RequestOutput]):
    return [lp for o in outs for lp in o.logprobs or ()]


def test_logprobs_match_transformers_log_softmax(llama, checkpoint):
    ref = load_hf_reference(checkpoint)
    ids = prompt()
    params = SamplingOptions(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)
    (outs,) = run_requests(engine(llama), [ids], params)
    got, lps = tokens(outs), logprobs(outs)
    assert len(lps) == len(got) == 8
    with torch.no_grad():
        full = ref(input_ids=torch.tensor([ids + got])).logits[0].log_softmax(-1)
    for i, (token, lp) in enumerate(zip(got, lps, strict=True)):
        row = full[len(ids) - 1 + i]
        assert lp.logprob == pytest.approx(row[token].item(), abs=1e-3)
        top = row.topk(5)
        assert lp.top_ids == tuple(top.indices.tolist())
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-3)
        assert lp.top_ids[0] == token  # greedy


def test_repetition_penalty_matches_transformers_generate(llama, checkpoint):
    ref = load_hf_reference(checkpoint)
    ids = prompt(12)
    params = SamplingOptions(max_tokens=10, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    (outs,) = run_requests(engine(llama), [ids], params)
    with torch.no_grad():
        hf = ref.generate(
            torch.tensor([ids]),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.5,
            min_new_tokens=10,
            pad_token_id=0,
        )
    assert tokens(outs) == hf[0, len(ids) :].tolist()
    plain = tokens(
        run_requests(engine(llama), [ids], SamplingOptions(max_tokens=10, temperature=0))[0]
    )
    assert tokens(outs) != plain  # the penalty changed the output


def chain_drafter(reference: list[list[int]], k: int, wrong_every: int = 3):
    """Chains of the reference's next ``k`` tokens, every ``wrong_every``-th one wrong."""

    def drafter(rid: str, done: list[int]) -> DraftTree | None:
        ref = reference[int(rid[1:])]
        nxt = ref[len(done) : len(done) + k]
        nxt = [
            (t + 1) % 256 if (len(done) + j) % wrong_every == 0 else t for j, t in enumerate(nxt)
        ]
        return DraftTree.chain(nxt) if nxt else None

    return drafter


def test_every_option_gives_the_same_tokens_and_logprobs_with_drafts(llama):
    ps = [prompt(37, 1), prompt(20, 2)]
    params = [
        EVERY_OPTION,
        SamplingOptions(
            max_tokens=14,
            temperature=0,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            logprobs=1,
            ignore_eos=True,
        ),
    ]
    plain = run_requests(engine(llama), ps, params)
    expected = [tokens(o) for o in plain]
    drafted = run_requests(engine(llama), ps, params, chain_drafter(expected, 4))
    assert [tokens(o) for o in drafted] == expected
    assert sum(o.accepted_drafts for outs in drafted for o in outs) > 0
    for a, b in zip(plain, drafted, strict=True):
        assert [x.top_ids for x in logprobs(a)] == [x.top_ids for x in logprobs(b)]
        assert [x.logprob for x in logprobs(a)] == pytest.approx(
            [x.logprob for x in logprobs(b)], abs=1e-4
        )


def test_min_tokens_holds_back_a_stop_token(llama):
    ids = prompt()
    free = tokens(
        run_requests(engine(llama), [ids], SamplingOptions(max_tokens=12, temperature=0))[0]
    )
    stop = free[1]
    stopped = tokens(
        run_requests(
            engine(llama),
            [ids],
            SamplingOptions(max_tokens=12, temperature=0, stop_token_ids=(stop,)),
        )[0]
    )
    assert stopped == free[:2]
    held = tokens(
        run_requests(
            engine(llama),
            [ids],
            SamplingOptions(max_tokens=12, temperature=0, stop_token_ids=(stop,), min_tokens=6),
        )[0]
    )
    assert len(held) >= 6 and stop not in held[:5]


def test_handoff_carries_the_first_tokens_logprobs(llama):
    ids = prompt(40)
    expected = run_requests(engine(llama), [ids], EVERY_OPTION)[0]
    prefill = engine(llama)
    decode = engine(llama, kv_buffer=bytearray(64 * prefill.kv_pool.spec.block_bytes))
    chunks, reserved = prefill_handoff(prefill, decode, ids, EVERY_OPTION)
    last = chunks[-1]
    with pytest.raises(RequestError, match="logprobs"):
        decode.admit_prefilled("x", ids, list(reserved), last.first_token, EVERY_OPTION)
    decode.admit_prefilled("r", ids, reserved, last.first_token, EVERY_OPTION, last.first_logprobs)
    rest = []
    while decode.has_unfinished():
        rest += decode.step()
    assert [last.first_token, *tokens(rest)] == tokens(expected)
    got = [last.first_logprobs, *logprobs(rest)]
    assert [lp.top_ids for lp in got] == [lp.top_ids for lp in logprobs(expected)]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in logprobs(expected)])


def test_token_ids_outside_the_vocabulary_are_refused(llama):
    eng = engine(llama)
    with pytest.raises(RequestError, match="logit_bias"):
        eng.add_request("r", [1, 2], SamplingOptions(logit_bias={10**6: 1.0}))


def run_choices(eng: LLMEngine, prompt_ids, params) -> dict[int, list[RequestOutput]]:
    eng.add_request("r", prompt_ids, params)
    outs: dict[int, list[RequestOutput]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == "r"
            outs.setdefault(out.index, []).append(out)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    eng.block_manager.check_invariants()
    return outs


def count_computed(eng: LLMEngine) -> list[int]:
    """Tokens the engine computes per forward pass, recorded."""
    counts: list[int] = []
    execute = eng.runner.execute

    def counting(seqs, num_new, *args, **kwargs):
        counts.append(sum(num_new))
        return execute(seqs, num_new, *args, **kwargs)

    eng.runner.execute = counting
    return counts


@pytest.mark.parametrize("prompt_len", [37, 48])  # a partial last block, and a full one
def test_n_choices_share_the_prompt_and_each_equals_its_own_seeded_run(llama, prompt_len):
    from kvmesh.shared.engine.sequence import choice_seed

    ids = prompt(prompt_len, 5)
    params = SamplingOptions(
        max_tokens=10, temperature=1.0, seed=3, n=4, logprobs=1, ignore_eos=True
    )
    eng = engine(llama, block_size=16)
    computed = count_computed(eng)
    outs = run_choices(eng, ids, params)
    assert sorted(outs) == [0, 1, 2, 3] and all(o[-1].finished for o in outs.values())
    assert sum(computed) == prompt_len + 3 + 4 * 9  # the prompt once, a token per other choice
    got = {i: tokens(o) for i, o in outs.items()}
    assert len({tuple(t) for t in got.values()}) == 4  # the choices differ
    for i, toks in got.items():
        seed = 3 if i == 0 else choice_seed(3, i)
        alone = msgspec.structs.replace(params, n=1, seed=seed)
        assert toks == tokens(run_requests(engine(llama, block_size=16), [ids], alone)[0]), i
        assert len(logprobs(outs[i])) == 10


def test_n_choices_after_a_prefill_handoff_and_when_aborted(llama):
    ids = prompt(40, 6)
    params = SamplingOptions(max_tokens=6, temperature=0.8, seed=9, n=3, ignore_eos=True)
    expected = {i: tokens(o) for i, o in run_choices(engine(llama), ids, params).items()}
    prefill = engine(llama)
    decode = engine(llama, kv_buffer=bytearray(64 * prefill.kv_pool.spec.block_bytes))
    chunks, reserved = prefill_handoff(prefill, decode, ids, params)
    decode.admit_prefilled("r", ids, reserved, chunks[-1].first_token, params)
    got: dict[int, list[int]] = {0: [chunks[-1].first_token]}
    while decode.has_unfinished():
        for out in decode.step():
            got.setdefault(out.index, []).extend(out.new_token_ids)
    assert got == expected
    eng = engine(llama)
    eng.add_request("a", ids, params)
    eng.step()
    eng.step()
    assert eng.abort("a")
    outs = eng.step()
    assert sorted(o.index for o in outs if o.finish_reason == "abort") == [0, 1, 2]
    assert eng.block_manager.num_free_blocks == 64 and not eng.has_unfinished()


@pytest.mark.parametrize("budget", [512, 16])  # one pass, and chunks
def test_prompt_logprobs_match_transformers_with_ranks(llama, checkpoint, budget):
    ref = load_hf_reference(checkpoint)
    ids = prompt(37, 8)
    params = SamplingOptions(max_tokens=2, temperature=0, prompt_logprobs=2, ignore_eos=True)
    eng = engine(llama, max_num_batched_tokens=budget, block_size=16)
    eng.add_request("warm", ids, SamplingOptions(max_tokens=1))  # its blocks stay cached
    while eng.has_unfinished():
        eng.step()
    (outs,) = run_requests(eng, [ids], params)  # computes the whole prompt despite the cache
    scored = outs[0].prompt_logprobs
    assert all(o.prompt_logprobs is None for o in outs[1:])
    with torch.no_grad():
        lp = ref(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    assert len(scored) == len(ids) - 1
    for i, got in enumerate(scored):
        row, token = lp[i], ids[i + 1]
        assert got.logprob == pytest.approx(row[token].item(), abs=1e-3)
        assert got.rank == int((row > row[token]).sum()) + 1
        assert got.top_ids == tuple(row.topk(2).indices.tolist())


def test_prompt_logprobs_cross_a_prefill_handoff(llama):
    ids = prompt(40, 9)
    params = SamplingOptions(max_tokens=3, temperature=0, prompt_logprobs=0, ignore_eos=True)
    expected = run_requests(engine(llama), [ids], params)[0][0].prompt_logprobs
    prefill = engine(llama, max_num_batched_tokens=16)
    chunks = []
    prefill.add_request("r", ids, params, prefill_only=True, on_chunk=chunks.append)
    while prefill.has_unfinished():
        prefill.step()
    got = chunks[-1].prompt_logprobs
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in expected])
    assert [lp.rank for lp in got] == [lp.rank for lp in expected]
    assert all(not c.prompt_logprobs for c in chunks[:-1])
