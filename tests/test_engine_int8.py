"""The engine with an int8 KV cache: every decode path alike (the C kernels against the torch
path, token for token and byte for byte), lossless draft verification (a token's bytes depend on
that token alone), its pool size, and int8 blocks never mistaken for others.

Its accuracy on a trained model is measured by ``kvmesh model kv-accuracy`` (docs/kv_cache.md);
on kvmesh-tiny (16 greedy tokens per prompt) 95.3% of greedy tokens agree with float32 KV (7 of 8
prompts on all 16, one flips a near tie after 10), logit error at most 0.0001, mean 0.00002
(fp8: 93.0%, 0.0009, 0.00013)."""

from __future__ import annotations

import random

import pytest
import torch
from kvmesh.loadgen.kv_accuracy import FIXTURE_PROMPTS, measure
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.model.loader import load_model
from kvmesh.shared.prefix_hash import layout_root
from kvmesh.shared.sampling import SamplingOptions


@pytest.fixture(scope="module")
def tiny():
    return load_model("kvmesh-tiny", torch.float32)


@pytest.fixture(scope="module")
def fixture_prompts(tiny) -> list[list[int]]:
    _, tokenizer = tiny
    return [tokenizer.encode(text, add_special_tokens=True) for text in FIXTURE_PROMPTS]


def test_int8_greedy_output_agrees_with_float32_kv_on_the_fixture_prompts(tiny, fixture_prompts):
    report = measure(tiny[0], fixture_prompts, max_tokens=16, kv_cache_dtype="int8")
    assert report.token_agreement >= 0.9  # measured 0.953
    assert report.max_logit_error <= 0.001  # measured 0.0001
    assert report.logit_std > 100 * report.max_logit_error


def test_int8_decode_through_c_kernels_equals_the_torch_path(tiny, fixture_prompts):
    model, tokenizer = tiny
    params = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = [
        LLMEngine(
            model,
            tokenizer,
            EngineConfig(num_blocks=256, kv_cache_dtype="int8", cpu_kernels=kernels),
        )
        for kernels in (True, False)
    ]
    outputs = [e.generate(fixture_prompts[:4], params) for e in engines]
    assert outputs[0] == outputs[1]
    assert engines[0].runner.cpu_ops is not None, "no C compiler: the C path did not run"
    # the same bytes, scales included, in the pools
    assert torch.equal(engines[0].kv_pool.raw, engines[1].kv_pool.raw)


def test_int8_pool_holds_32_36ths_of_fp8s_blocks_in_the_same_bytes(tiny):
    model, tokenizer = tiny
    blocks = {}
    for dtype in ("auto", "int8", "fp8_e4m3"):
        config = EngineConfig(kv_cache_bytes=4 << 20, kv_cache_dtype=dtype)
        engine = LLMEngine(model, tokenizer, config)
        blocks[dtype] = engine.kv_pool.spec.block_bytes
    # a float32 per 32 one-byte values: 36 bytes per 32 values, against 128 for float32
    assert blocks["int8"] * 128 == blocks["auto"] * 36
    assert blocks["fp8_e4m3"] < blocks["int8"] < blocks["auto"] // 3


def test_int8_blocks_never_share_a_prefix_hash_with_other_dtypes(tiny):
    model, tokenizer = tiny
    specs = [
        LLMEngine(model, tokenizer, EngineConfig(num_blocks=8, kv_cache_dtype=d)).kv_spec
        for d in ("auto", "int8", "fp8_e4m3")
    ]
    assert "int8" in specs[1]
    assert len({layout_root(s) for s in specs}) == 3


@pytest.mark.parametrize("kernels", [True, False])
def test_int8_with_random_draft_chains_and_trees_equals_plain_int8_decoding(tiny, kernels):
    """Lossless by construction: a rejected draft's K/V never touches a kept token's bytes, and an
    accepted node moves with its own scales. Every block comes back."""
    model, tokenizer = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (20, 37, 9, 50)]
    params = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)

    def engine() -> LLMEngine:
        config = EngineConfig(
            num_blocks=128, block_size=8, kv_cache_dtype="int8", cpu_kernels=kernels
        )
        return LLMEngine(model, tokenizer, config)

    plain = engine().generate(prompts, params)
    for shape in ("chain", "tree"):
        eng = engine()
        for i, prompt in enumerate(prompts):
            eng.add_request(f"r{i}", prompt, params)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while eng.has_unfinished():
            drafts = {}
            for rid, done in got.items():
                tokens = [rng.randrange(256) for _ in range(4)]
                nxt = plain[int(rid[1:])][len(done) : len(done) + 1]
                if shape == "tree" and done and nxt:  # the right token as the second root
                    tokens[1] = nxt[0]  # child: kept, its KV moved over the first's slot
                parents = (-1, 0, 1, 2) if shape == "chain" else (-1, -1, 0, 1)
                drafts[rid] = DraftTree(tuple(tokens), parents)
            for out in eng.step(drafts):
                got[out.request_id] += out.new_token_ids
        assert [got[f"r{i}"] for i in range(len(prompts))] == plain, shape
        assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_kv_accuracy_against_llama_cpp_needs_a_checkpoint_directory():
    from kvmesh import cli

    with pytest.raises(SystemExit, match="converts a checkpoint directory"):
        cli.main(["model", "kv-accuracy", "kvmesh-tiny", "--llama-cpp"])
