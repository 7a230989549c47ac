"""LLMEngine end to end on tiny HF checkpoints: equality with transformers, batching, chunking,
prefix caching, speculative scoring + rollback, KV handoff between two engines, limits."""

import random

import pytest
import torch
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import PromptTooLongError, RequestError
from kvmesh.shared.model import load_model
from kvmesh.shared.text.sampling import SamplingOptions
from support.engine_handoff import chunk_copier
from support.hf_fixtures import load_hf_reference

GREEDY = SamplingOptions(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(hf_checkpoints):
    return load_model(str(hf_checkpoints["llama"]))


def prompts(n: int, lengths: tuple[int, ...] = (70, 23, 41, 5), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def engine(model_tok, kv_buffer=None, **kw) -> LLMEngine:
    model, tok = model_tok
    kw.setdefault("num_blocks", 64)
    return LLMEngine(model, tok, EngineConfig(**kw), kv_buffer=kv_buffer)


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            nxt = ref(input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_alone_and_in_a_mixed_batch(hf_checkpoints, arch):
    path = hf_checkpoints[arch]
    model_tok = load_model(str(path))
    ref = load_hf_reference(path)
    ps = prompts(3)
    expected = [hf_greedy(ref, p, GREEDY.max_tokens) for p in ps]
    eng = engine(model_tok, max_num_batched_tokens=48)
    assert eng.generate(ps, GREEDY) == expected
    assert [eng.generate([p], GREEDY)[0] for p in ps] == expected
    assert eng.block_manager.num_free_blocks == 64


@pytest.mark.parametrize(("block_size", "budget"), [(4, 7), (16, 16), (16, 33)])
def test_chunked_prefill_equals_one_shot(llama, block_size, budget):
    ps = prompts(2, lengths=(70, 45))
    one_shot = engine(llama, max_num_batched_tokens=512).generate(ps, GREEDY)
    chunked = engine(llama, block_size=block_size, max_num_batched_tokens=budget)
    assert chunked.generate(ps, GREEDY) == one_shot


def test_prefix_cache_hit_equals_miss(llama):
    base = prompts(1, lengths=(50,))[0]
    second = [*base[:48], 1, 2, 3, 4, 5]
    eng = engine(llama)
    calls = []
    execute = eng.runner.execute
    eng.runner.execute = lambda seqs, n, k: (calls.append(list(n)), execute(seqs, n, k))[1]
    eng.generate([base], GREEDY)
    calls.clear()
    hit = eng.generate([second], GREEDY)
    assert calls[0] == [len(second) - 48]  # three 16-token blocks came from the cache
    miss = engine(llama, enable_prefix_caching=False).generate([second], GREEDY)
    assert hit == miss


def test_preemption_recomputes_to_the_same_tokens(llama):
    ps = prompts(4, lengths=(30, 31, 29, 33))
    params = SamplingOptions(max_tokens=20, temperature=0, ignore_eos=True)
    roomy = engine(llama).generate(ps, params)
    tight = engine(llama, num_blocks=10)
    assert tight.generate(ps, params) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 10


def decode_until(eng: LLMEngine, rid: str, num_tokens: int) -> list[int]:
    got: list[int] = []
    while len(got) < num_tokens:
        for out in eng.step():
            if out.request_id == rid:
                got += out.new_token_ids
    return got


def test_score_equals_single_steps_and_rollback_restores_state(llama):
    prompt = prompts(1, lengths=(29,))[0]
    params = SamplingOptions(max_tokens=30, temperature=0, ignore_eos=True)
    ref = engine(llama).generate([prompt], params)[0]
    K = 5
    eng = engine(llama)
    eng.add_request("r", prompt, params)
    assert decode_until(eng, "r", 1) == ref[:1]
    free_before = eng.block_manager.num_free_blocks
    logits = eng.score("r", ref[1 : 1 + K])  # positions 29..34 cross the block boundary at 32
    assert logits.shape == (K + 1, llama[0].config.vocab_size)
    assert logits.argmax(-1).tolist() == ref[1 : 2 + K]
    assert eng.block_manager.num_free_blocks < free_before
    eng.rollback("r", K)
    assert eng.block_manager.num_free_blocks == free_before
    assert decode_until(eng, "r", 8) == ref[1:9]


def test_accept_keeps_accepted_drafts_and_continues_identically(llama):
    prompt = prompts(1, lengths=(30,))[0]
    params = SamplingOptions(max_tokens=30, temperature=0, ignore_eos=True)
    ref = engine(llama).generate([prompt], params)[0]
    eng = engine(llama)
    eng.add_request("r", prompt, params)
    decode_until(eng, "r", 1)
    drafts = [*ref[1:4], (ref[4] + 1) % 256]  # the fourth draft is wrong
    logits = eng.score("r", drafts)
    out = eng.accept("r", 3, int(logits[3].argmax()))
    assert out.new_token_ids == ref[1:5] and out.num_output_tokens == 5
    assert decode_until(eng, "r", 6) == ref[5:11]
    with pytest.raises(RequestError, match="roll back"):
        eng.rollback("r", 100)


@pytest.mark.parametrize(
    "params",
    [
        SamplingOptions(max_tokens=10, temperature=0, ignore_eos=True),
        SamplingOptions(max_tokens=10, temperature=1.5, top_k=50, seed=1234, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_prefill_handoff_to_second_engine_gives_same_tokens(llama, params):
    prompt = prompts(1, lengths=(75,))[0]
    expected = engine(llama).generate([prompt], params)[0]
    prefill = engine(llama, max_num_batched_tokens=40)
    spec = prefill.kv_pool.spec
    decode = engine(llama, kv_buffer=bytearray(64 * spec.block_bytes))
    reserved = decode.reserve_blocks(len(prompt))
    chunks, on_chunk = chunk_copier(prefill, decode, reserved)

    prefill.add_request("r", prompt, params, prefill_only=True, on_chunk=on_chunk)
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    assert [(c.start_token, c.end_token) for c in chunks] == [(0, 32), (32, 64), (64, 75)]
    assert [len(c.block_ids) for c in chunks] == [2, 2, 1] and chunks[-1].is_last
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    first = chunks[-1].first_token
    assert outs[-1].finish_reason == "prefill_done" and outs[-1].new_token_ids == [first]
    assert prefill.block_manager.num_free_blocks == 64 - 5  # held until release
    prefill.release("r")
    assert prefill.block_manager.num_free_blocks == 64
    decode.admit_prefilled("r", prompt, reserved, first, params)
    rest = []
    while decode.has_unfinished():
        rest += [t for o in decode.step() for t in o.new_token_ids]
    assert [first, *rest] == expected
    assert decode.block_manager.num_free_blocks == 64


def test_abort_frees_blocks_and_reports_abort(llama):
    eng = engine(llama)
    eng.add_request("a", prompts(1)[0], SamplingOptions(max_tokens=50, temperature=0))
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_blocks < 64
    assert eng.abort("a") is True
    assert eng.abort("a") is False
    assert eng.block_manager.num_free_blocks == 64
    (out,) = eng.step()
    assert out.finished and out.finish_reason == "abort"
    assert not eng.has_unfinished()


def test_engine_config_errors_say_what_to_fix():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(num_blocks=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="at least block_size"):
        EngineConfig(block_size=16, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        EngineConfig(kv_cache_bytes=10).resolve_num_blocks(1024)
    assert EngineConfig(kv_cache_bytes=1 << 20).resolve_num_blocks(1 << 16) == 16


def test_prompt_longer_than_context_is_refused_with_a_message(llama):
    eng = engine(llama, max_model_len=64)
    with pytest.raises(PromptTooLongError, match="max_model_len is 64"):
        eng.add_request("x", [1] * 65, GREEDY)
    small = engine(llama, num_blocks=2)
    with pytest.raises(PromptTooLongError, match="KV pool holds only 32"):
        small.add_request("y", [1] * 40, GREEDY)
    with pytest.raises(RequestError, match="empty"):
        eng.add_request("z", [], GREEDY)


def test_generation_stops_at_max_model_len(llama):
    eng = engine(llama, max_model_len=40)
    out = eng.generate([[5] * 35], SamplingOptions(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out[0]) == 5


def test_seeded_sampling_is_reproducible_across_batches(llama):
    ps = prompts(3)
    seeded = SamplingOptions(max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    other = SamplingOptions(max_tokens=10, temperature=1.0)
    alone = engine(llama).generate([ps[0]], seeded)[0]
    batched = engine(llama).generate(ps, [other, seeded, other])
    assert engine(llama).generate([ps[1]], seeded)[0] == batched[1]
    assert (
        alone
        != engine(llama).generate([ps[0]], SamplingOptions(max_tokens=10, temperature=1.0, seed=8))[
            0
        ]
    )


def test_sequence_filling_the_whole_pool_stops_with_length(llama):
    eng = engine(llama, num_blocks=3)  # 48 tokens in all
    out = eng.generate([[7] * 40], SamplingOptions(max_tokens=100, temperature=0, ignore_eos=True))
    assert len(out[0]) == 8
    assert eng.block_manager.num_free_blocks == 3


def test_admitted_request_ended_by_its_first_token_finishes_and_frees_blocks(llama):
    eng = engine(llama)
    prompt = prompts(1, lengths=(20,))[0]
    blocks = eng.reserve_blocks(len(prompt))
    assert len(blocks) == 2 and eng.block_manager.num_free_blocks == 62
    eng.admit_prefilled("r", prompt, blocks, 9, SamplingOptions(max_tokens=1, temperature=0))
    (out,) = eng.step()
    assert out.finished and out.finish_reason == "length" and out.new_token_ids == []
    assert eng.block_manager.num_free_blocks == 64
    with pytest.raises(RequestError, match="need 2 blocks"):
        eng.admit_prefilled("s", prompt, eng.reserve_blocks(5), 9, GREEDY)


def test_abort_after_prefill_done_releases_the_held_blocks(llama):
    eng = engine(llama)
    eng.add_request("p", prompts(1)[0], GREEDY, prefill_only=True)
    (out,) = eng.step()
    assert out.finish_reason == "prefill_done" and eng.block_manager.num_free_blocks < 64
    assert eng.abort("p") is True
    assert eng.block_manager.num_free_blocks == 64 and not eng.has_unfinished()


def test_no_decode_budget_prefills_the_oldest_prompt_at_once_with_the_same_tokens(llama):
    ps = prompts(3, lengths=(70, 45, 60))
    chunked = engine(llama, max_num_batched_tokens=16)
    calls = []
    expected = chunked.generate(ps, GREEDY)
    fast = engine(llama, max_num_batched_tokens=16, max_num_batched_tokens_no_decode=128)
    execute = fast.runner.execute
    fast.runner.execute = lambda seqs, n, k: (calls.append(list(n)), execute(seqs, n, k))[1]
    assert fast.generate(ps, GREEDY) == expected
    assert calls[0] == [70]  # the first prompt whole, nothing riding along; then the budget
    assert all(sum(n) <= 16 for n in calls if 1 in n)  # a step with a decode keeps the budget
