"""The engine with an fp8 KV cache: what it costs in accuracy (measured bounds, kvmesh-tiny on
the fixture prompts of ``loadgen/kv_accuracy.py``) and fp8 blocks never mistaken for float32
ones (every decode path alike and draft verification: test_engine_8bit.py).

Measured (kvmesh-tiny, 16 greedy tokens per prompt; docs/kv_cache.md has the 23M model): every
prompt agrees for at least 11 tokens and 6 of 8 agree on all 16; teacher-forced top-1 agreement
0.938 or better per prompt (one position of 16); logit error at most 0.0009, mean 0.00013
(the logits' spread: 0.32). The bounds below leave a margin; the flips are real quantization
effects on near-tied logits of a random model (float32 through the C kernels and through torch
agree on every token)."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.kv_accuracy import FACT_QUESTIONS, FIXTURE_PROMPTS
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.prefix_hash import layout_root
from support.kv_accuracy_runs import fixture_prompts_report


def test_fp8_greedy_output_agrees_with_float32_kv_on_the_fixture_prompts(tiny_float32):
    report = fixture_prompts_report(tiny_float32, "fp8_e4m3")
    assert report.min_agreed_tokens >= 8  # measured 11
    assert report.num_fully_agreed >= 5  # measured 6 of 8
    assert min(p.top1_agreement for p in report.prompts) >= 0.85  # measured 0.938
    assert report.max_logit_error <= 0.005  # measured 0.0009
    assert report.logit_std > 50 * report.max_logit_error  # small against the logits' spread


def test_fp8_pool_holds_four_times_the_blocks_of_float32_in_the_same_bytes(tiny_float32):
    model, tokenizer = tiny_float32
    sizes = {}
    for dtype in ("auto", "fp8_e4m3"):
        config = EngineConfig(kv_cache_bytes=4 << 20, kv_cache_dtype=dtype)
        engine = LLMEngine(model, tokenizer, config)
        sizes[dtype] = engine.kv_pool.num_blocks, engine.kv_pool.spec.bytes_per_token
    assert sizes["fp8_e4m3"][1] * 4 == sizes["auto"][1]
    assert sizes["fp8_e4m3"][0] > 3.9 * sizes["auto"][0]  # scales: 8 bytes per (layer, head)


def test_fp8_and_float32_blocks_never_share_a_prefix_hash(tiny_float32):
    model, tokenizer = tiny_float32
    specs = [
        LLMEngine(model, tokenizer, EngineConfig(num_blocks=8, kv_cache_dtype=d)).kv_spec
        for d in ("auto", "fp8_e4m3")
    ]
    assert "float8_e4m3fn" in specs[1] and "float32" in specs[0]
    assert layout_root(specs[0]) != layout_root(specs[1])


def test_engine_config_refuses_an_unknown_kv_cache_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4")


def test_up_gives_prefill_and_decode_their_kv_cache_dtypes():
    from kvmesh.commands.serve import build_service_config
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_plan import plan

    both = UpConfig(kv_cache_dtype="fp8_e4m3")
    decode_only = UpConfig(decode_kv_cache_dtype="fp8_e4m3")
    for config, expected in ((both, "fp8_e4m3"), (decode_only, "auto")):
        for spec in plan(config, "nats://127.0.0.1:4222", 8000):
            if spec.argv[1] in ("prefill", "decode"):
                _, service, _ = build_service_config(spec.argv[1], spec.argv[2:], env={})
                want = "fp8_e4m3" if spec.argv[1] == "decode" else expected
                assert service.kv_cache_dtype == want, spec.argv


def test_kv_accuracy_command_reports_every_fixture_prompt(capsys):
    import json

    from kvmesh import cli

    assert cli.main(["model", "kv-accuracy", "kvmesh-tiny", "--max-tokens", "3", "--json"]) == 0
    reports = json.loads(capsys.readouterr().out)["reports"]
    assert [r["kv_cache_dtype"] for r in reports] == ["int8", "fp8_e4m3", "bf16"]
    for report in reports:
        assert report["max_tokens"] == 3 and len(report["prompts"]) == len(FIXTURE_PROMPTS)
        assert 0 <= report["min_agreed_tokens"] <= 3 and 0 <= report["token_agreement"] <= 1
        if report["kv_cache_dtype"] == "bf16":  # the yardstick: greedy only, not teacher-forced
            assert report["max_logit_error"] is None and report["top1_agreement"] is None
        else:
            assert report["max_logit_error"] >= 0
            top1 = [p["top1_agreement"] for p in report["prompts"]]
            assert report["top1_agreement"] == pytest.approx(sum(top1) / len(top1))
        assert len(report["facts"]) == len(FACT_QUESTIONS)
        gaps = [p["flip_gap"] for p in report["prompts"] if p["flip_gap"] is not None]
        assert report["flip_gaps"] == sorted(gaps) and all(g >= 0 for g in gaps)
        parted = [p for p in report["prompts"] if p["agreed_tokens"] < 3]
        assert len(gaps) == len(parted)  # a margin for each prompt whose tokens part
