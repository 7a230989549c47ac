"""`kvmesh bench engine`: the JSON the issue asks for, from a short real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("kernels", [[], ["--no-cpu-kernels"]])
def test_bench_engine_json_has_both_systems_and_every_batch_size(kernels):
    short = ["--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4"]
    short += ["--batch-sizes", "1,3", "--repeats", "1", *kernels]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "engine", "--json", *short],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for system in ("kvmesh", "transformers"):
        assert result[system]["prefill_tok_s"] > 0
        assert set(result[system]["decode_tok_s"]) == {"1", "3"}
        assert all(v > 0 for v in result[system]["decode_tok_s"].values())
    assert result["config"]["greedy_outputs_match"] is True
    assert result["config"]["cpu_kernels"] is (not kernels)
    assert set(result["ratios"]["decode"]) == {"1", "3"}


def _bench_engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "engine", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_engine_against_llama_cpp_says_what_is_missing(tmp_path):
    converter = tmp_path / "nowhere" / "convert_hf_to_gguf.py"
    proc = _bench_engine("--against", "llama.cpp", "--gguf-converter", str(converter))
    assert proc.returncode != 0
    assert "make bench-deps" in proc.stderr
    assert str(converter) in proc.stderr
    assert proc.stdout == ""  # refused before any model is loaded or measured


@pytest.mark.parametrize("kv_cache", ["same", "f16"])
def test_bench_engine_against_llama_cpp_compares_ratios_and_tokens(kv_cache):
    from kvmesh.loadgen.llamacpp_runner import converter_path, missing

    lacks = missing(converter_path())
    if lacks:
        pytest.skip("llama.cpp comparison not installed (make bench-deps): " + "; ".join(lacks))
    short = ["--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4"]
    proc = _bench_engine(
        "--json",
        "--against",
        "llama.cpp",
        *short,
        *("--batch-sizes", "1,2", "--repeats", "1", "--llama-kv-cache", kv_cache),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # batch 2 as llama-server's parallel slots decode it (one llama_decode a step)
    assert set(result["llama.cpp"]["decode_tok_s"]) == {"1", "2"}
    assert set(result["ratios_llama_cpp"]["decode"]) == {"1", "2"}
    assert set(result["ratios"]["decode"]) == {"1", "2"}
    assert result["config"]["greedy_outputs_match_llama_cpp"] is True
    assert result["config"]["llama_kv_cache"] == kv_cache


@pytest.fixture(scope="module")
def stored_gguf(tmp_path_factory):
    """A small synthetic Llama as a GGUF file of Q4_1, Q4_0 and Q8_0 weights (kept as stored
    when kvmesh imports it), and a cache folder of its own for the import."""
    from support.gguf_fixtures import write_gguf

    root = tmp_path_factory.mktemp("stored-bench")
    path = root / "small.gguf"
    write_gguf(path, types=("Q4_1", "Q4_0", "Q8_0"))
    return path, root / "cache"


def test_bench_engine_on_weights_as_stored_measures_against_kvmeshs_float32(stored_gguf):
    """transformers cannot read blocks: the reference measured in the same run is kvmesh's engine
    on the same weights dequantized, and the ratios are against it."""
    import os

    path, cache = stored_gguf
    short = ["--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4"]
    short += ["--batch-sizes", "1,2", "--repeats", "1", "--kv-cache-dtype", "float16"]
    bench = [sys.executable, "-m", "kvmesh.cli", "bench", "engine", "--json"]
    proc = subprocess.run(
        [*bench, "--model", str(path), *short],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVMESH_CACHE_DIR": str(cache)},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert "transformers" not in result
    assert result["config"]["reference"] == "kvmesh-float32"
    assert result["config"]["weights"].startswith("as stored: ")
    for system in ("kvmesh", "kvmesh-float32"):
        assert set(result[system]["decode_tok_s"]) == {"1", "2"}
        assert all(v > 0 for v in result[system]["decode_tok_s"].values())
    ratio = result["kvmesh"]["decode_tok_s"]["1"] / result["kvmesh-float32"]["decode_tok_s"]["1"]
    assert result["ratios"]["decode"]["1"] == round(ratio, 2)
    # bytes a step reads against memcpy's bandwidth measured in the run; --kv-cache-dtype is
    # kvmesh's, the reference keeps its model's float32
    band = result["bandwidth"]
    assert band["memcpy_gb_s"] > 0
    assert band["kvmesh"]["kv_dtype"] == result["config"]["kv_cache_dtype"] == "float16"
    assert band["kvmesh-float32"]["kv_dtype"] == "float32"
    for system in ("kvmesh", "kvmesh-float32"):
        rows = band[system]["decode"]
        assert set(rows) == {"1", "2"}
        # batch 2 shares the weights' bytes between two tokens
        assert 0 < rows["2"]["mb_per_token"] < rows["1"]["mb_per_token"]
    # stored blocks and a half KV: fewer bytes a token than float32 weights and KV
    assert (
        band["kvmesh"]["decode"]["1"]["mb_per_token"]
        < (band["kvmesh-float32"]["decode"]["1"]["mb_per_token"])
    )


def test_decode_bytes_count_every_weight_a_step_reads_and_the_context_kv():
    import torch
    from kvmesh.loadgen.bench_engine import KV_CACHE_DTYPES
    from kvmesh.loadgen.engine_bandwidth import decode_bytes, decode_weight_bytes
    from kvmesh.shared.engine.config import KV_CACHE_DTYPES as ENGINE_KV_CACHE_DTYPES
    from kvmesh.shared.model import load_model
    from kvmesh.shared.model.quant import quantize
    from kvmesh.shared.model.quant_layers import use_quant_weights

    assert KV_CACHE_DTYPES == ENGINE_KV_CACHE_DTYPES
    model, _ = load_model("kvmesh-tiny")
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    head = model.output if model.output is not None else model.tok_embeddings
    expected = sum(m.weight.nbytes for m in linears) + head.weight.nbytes
    assert decode_weight_bytes(model) == expected
    # an embedding kept as stored: its table is read once, though its tied head is a module too
    table = quantize(model.tok_embeddings.weight.detach(), "Q8_0")
    use_quant_weights(model, {"tok_embeddings.weight": table})
    if model.output is None:
        expected += table.data.nbytes - head.weight.nbytes
    assert decode_weight_bytes(model) == expected
    assert decode_bytes(1000, 10.0, 3, 20.5) == 1000 + 3 * 20.5 * 10.0


def test_engine_rss_weights_count_a_tied_heads_storage_once():
    """``--memory``'s weights figure: every tensor the model holds, a weight kept as stored and
    the LM head sharing the embeddings' blocks counted once."""
    import torch
    from kvmesh.loadgen.engine_rss import weights_bytes
    from kvmesh.shared.model.quant import quantize
    from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
    from torch import nn

    model = nn.Module()
    model.embed = QuantEmbedding(quantize(torch.randn(64, 32), "Q8_0"), torch.float32)  # + head
    model.proj = QuantLinear(quantize(torch.randn(16, 64), "Q4_1"), nn.Parameter(torch.ones(16)))
    model.register_buffer("table", torch.zeros(8, 4))
    assert model.embed.head.qweight is model.embed.qweight
    expected = 64 * 34 + 16 * 2 * 20 + 16 * 4 + 8 * 4 * 4  # Q8_0, Q4_1 blocks, bias, buffer
    assert weights_bytes(model) == expected
