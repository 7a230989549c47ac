"""The engine with an int8 KV cache: its accuracy, its pool size, and int8 blocks never mistaken
for others (every decode path alike and draft verification: test_engine_8bit.py).

Its accuracy on a trained model is measured by ``kvmesh model kv-accuracy`` (docs/kv_cache.md);
on kvmesh-tiny (16 greedy tokens per prompt) 95.3% of greedy tokens agree with float32 KV (7 of 8
prompts on all 16, one flips a near tie after 10), logit error at most 0.0001, mean 0.00002
(fp8: 93.0%, 0.0009, 0.00013)."""

from __future__ import annotations

import pytest
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.prefix_hash import layout_root
from support.kv_accuracy_runs import fixture_prompts_report


def test_int8_greedy_output_agrees_with_float32_kv_on_the_fixture_prompts(tiny_float32):
    report = fixture_prompts_report(tiny_float32, "int8")
    assert report.token_agreement >= 0.9  # measured 0.953
    assert report.max_logit_error <= 0.001  # measured 0.0001
    assert report.logit_std > 100 * report.max_logit_error


def test_int8_pool_holds_32_36ths_of_fp8s_blocks_in_the_same_bytes(tiny_float32):
    model, tokenizer = tiny_float32
    blocks = {}
    for dtype in ("auto", "int8", "fp8_e4m3"):
        config = EngineConfig(kv_cache_bytes=4 << 20, kv_cache_dtype=dtype)
        engine = LLMEngine(model, tokenizer, config)
        blocks[dtype] = engine.kv_pool.spec.block_bytes
    # a float32 per 32 one-byte values: 36 bytes per 32 values, against 128 for float32
    assert blocks["int8"] * 128 == blocks["auto"] * 36
    assert blocks["fp8_e4m3"] < blocks["int8"] < blocks["auto"] // 3


def test_int8_blocks_never_share_a_prefix_hash_with_other_dtypes(tiny_float32):
    model, tokenizer = tiny_float32
    specs = [
        LLMEngine(model, tokenizer, EngineConfig(num_blocks=8, kv_cache_dtype=d)).kv_spec
        for d in ("auto", "int8", "fp8_e4m3")
    ]
    assert "int8" in specs[1]
    assert len({layout_root(s) for s in specs}) == 3


def test_kv_accuracy_against_llama_cpp_needs_a_checkpoint_directory():
    from kvmesh import cli

    with pytest.raises(SystemExit, match="converts a checkpoint directory"):
        cli.main(["model", "kv-accuracy", "kvmesh-tiny", "--llama-cpp"])


def test_kv_accuracy_against_llama_cpp_says_what_is_missing_before_measuring(tmp_path, monkeypatch):
    """One line naming what to install, before any model is loaded (tmp_path holds none)."""
    from kvmesh.loadgen import llamacpp_runner

    from kvmesh import cli

    monkeypatch.setattr(llamacpp_runner, "missing", lambda converter: ["the llama_cpp module"])
    with pytest.raises(SystemExit, match=r"needs the llama_cpp module.*make bench-deps"):
        cli.main(["model", "kv-accuracy", str(tmp_path), "--llama-cpp"])
