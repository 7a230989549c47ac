"""The engine over each 8-bit KV format alike: every decode path gives the same tokens and the
same bytes (the C kernels against the torch path), and draft chains and trees leave plain greedy
decoding's output unchanged, every block coming back. int8 is lossless there by construction (a
token's bytes depend on that token alone); fp8 is not (a rejected draft may grow a tile's scale
before it is rolled back, docs/kv_cache.md) but is equal on these prompts, the trees' accepted
nodes moved between slots and blocks (requantized). Each format's accuracy, pool size and prefix
hashes: test_engine_int8.py and test_engine_fp8.py."""

from __future__ import annotations

import random

import pytest
import torch
from kvmesh.loadgen.kv_accuracy import FIXTURE_PROMPTS
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.text.sampling import SamplingOptions

FORMATS = ("int8", "fp8_e4m3")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_through_c_kernels_equals_the_torch_path(tiny_float32, kv_dtype):
    model, tokenizer = tiny_float32
    prompts = [tokenizer.encode(text, add_special_tokens=True) for text in FIXTURE_PROMPTS[:4]]
    params = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
    engines = [
        LLMEngine(
            model,
            tokenizer,
            EngineConfig(num_blocks=256, kv_cache_dtype=kv_dtype, cpu_kernels=kernels),
        )
        for kernels in (True, False)
    ]
    outputs = [e.generate(prompts, params) for e in engines]
    assert outputs[0] == outputs[1]
    assert engines[0].runner.cpu_ops is not None, "no C compiler: the C path did not run"
    # the same bytes, scales included, in the pools
    assert torch.equal(engines[0].kv_pool.raw, engines[1].kv_pool.raw)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_random_draft_chains_and_trees_keep_plain_greedy_output(tiny_float32, kv_dtype, kernels):
    model, tokenizer = tiny_float32
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (20, 37, 9, 50)]
    params = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)

    def engine() -> LLMEngine:
        config = EngineConfig(
            num_blocks=128, block_size=8, kv_cache_dtype=kv_dtype, cpu_kernels=kernels
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
