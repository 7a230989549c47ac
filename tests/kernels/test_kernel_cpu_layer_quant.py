"""kernels/cpu_layer.c's kv_decode_layer_quant: one decoder layer's decode step over weights kept
in their GGUF block formats, in one C call, against the same layer run module by module
(``QuantLinear`` on ``CpuOps.quant_linear`` and the separate kernels: bit for bit) and against
torch on the dequantized weights (close: the activations are quantized to int8)."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.cpu_ops import QuantDecodeLayerWeights
from kvmesh.shared.model import cpu_modules
from kvmesh.shared.model.cpu_modules import FusedDecodeBlock
from kvmesh.shared.model.quant import quantize
from kvmesh.shared.model.quant_layers import QuantLinear
from support.cpu_layers import (
    LINEARS,
    attach,
    decode_step,
    layer_config,
    quantized_twins,
    random_model,
    run_step,
    run_step_ways,
)


def _quant_models(config, formats):
    """The same layers twice: their linear weights as stored in ``formats`` (one per linear
    layer, LINEARS' order), and as the float32 values those blocks hold."""
    format_of = dict(zip(LINEARS, formats, strict=True))
    return quantized_twins(config, lambda name, weight: quantize(weight, format_of[name]))


@pytest.mark.parametrize(
    ("hidden", "inter", "heads", "kv_heads", "head_dim", "bias", "formats", "context_lens"),
    [
        (64, 96, 4, 2, 16, False, ("Q4_1",) * 4, [5]),  # batch 1, SmolLM2's format
        (96, 64, 6, 3, 16, True, ("Q4_1", "Q8_0", "Q4_0", "Q4_1"), [16, 3, 33, 9, 70]),
        (64, 128, 2, 1, 32, False, ("Q8_0", "Q4_0", "Q8_0", "Q4_0"), list(range(1, 16))),
    ],
)
@pytest.mark.parametrize("threads", [1, 3])
def test_quant_decode_layer_matches_the_module_path(
    ops, hidden, inter, heads, kv_heads, head_dim, bias, formats, context_lens, threads
):
    config = layer_config(hidden, inter, heads, kv_heads, head_dim, bias)
    stored, floats = _quant_models(config, formats)
    step = decode_step(config, context_lens)
    runs = run_step_ways(stored, ops, step, threads, reference=floats)
    assert all(isinstance(w, QuantDecodeLayerWeights) for w in runs.fused_weights)
    # the same kernels in the same order: bit for bit the per-module C calls
    assert torch.equal(runs.fused, runs.unfused)
    assert torch.equal(runs.fused_pool.tensor, runs.unfused_pool.tensor)
    # torch on the dequantized weights: only the activations' int8 rounding apart
    # (2.3-3.0 % measured: int8 rounding of every linear layer's input, two layers of random
    # weights whose attention and SiLU amplify it; the real model's tolerance is in
    # test_real_model_quant.py)
    assert (runs.fused - runs.reference).norm() / runs.reference.norm() < 5e-2
    assert not torch.equal(runs.fused, runs.reference)
    new = runs.fused_pool.tensor != step[0].tensor  # the step's K and V slots
    assert new.any()
    got, expected = runs.fused_pool.tensor[new], runs.reference_pool.tensor[new]
    assert (got - expected).norm() / expected.norm() < 3e-2  # 1.4 % measured


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_quant_decode_layer_splits_a_long_context_over_threads_bit_for_bit(ops, kv_dtype):
    """Batch 1 with 3 KV heads and 500 tokens (2 chunks of context each) on 2 threads: the
    fused layer splits the chunks, cutting units between threads, where the per-module kernels
    give each thread whole units; the same hidden state and KV bit for bit."""
    config = layer_config(96, 64, 6, 3, 16, False)
    stored, _ = _quant_models(config, ("Q4_1",) * 4)
    runs = run_step_ways(stored, ops, decode_step(config, [500], kv_dtype=kv_dtype), threads=2)
    assert torch.equal(runs.fused, runs.unfused)
    assert torch.equal(runs.fused_pool.tensor, runs.unfused_pool.tensor)


def test_a_decode_batch_of_16_rows_and_more_stays_on_the_kernel(ops, monkeypatch):
    """The fused layer quantizes every decode row (up to PACKED_LINEAR_MAX_ROWS), where the
    per-module path turns to a float GEMM from FLOAT_GEMM_ROWS on (for prefill chunks): with that
    threshold lifted, the two agree bit for bit, and each row is what it is alone."""
    config = layer_config(64, 96, 4, 2, 16, False)
    stored, _ = _quant_models(config, ("Q4_1",) * 4)
    lens = [3 + 5 * i for i in range(cpu_modules.FLOAT_GEMM_ROWS + 4)]
    pool, meta, input_ids, pos = decode_step(config, lens)
    fused, _ = run_step(stored, ops, pool, meta, input_ids, pos)
    monkeypatch.setattr(cpu_modules, "FLOAT_GEMM_ROWS", 10_000)
    unfused, _ = run_step(stored, ops, pool, meta, input_ids, pos, fused=False)
    attach(stored, None)
    assert torch.equal(fused, unfused)


def test_quant_decode_layer_is_attached_only_where_every_linear_is_stored(ops):
    config = layer_config(64, 96, 4, 2, 16, False)
    stored, _ = _quant_models(config, ("Q4_1",) * 4)
    attach(stored, ops)
    assert all(isinstance(lay.weights, QuantDecodeLayerWeights) for lay in stored.layers)
    # Q4_1 (2), in the paired layout (+ 16) where the kernels read it
    code = 2 | (16 if ops.quant_pairs else 0)
    assert stored.layers[0].weights.formats.tolist() == [code] * 4
    # one float32 linear layer among stored ones: that block runs module by module
    half, _ = _quant_models(config, ("Q4_1",) * 4)
    layer = half.layers[1].feed_forward
    float_down = random_model(config).layers[1].feed_forward.w_down
    layer.w_down = float_down
    attach(half, ops)
    assert isinstance(half.layers[0].weights, QuantDecodeLayerWeights)
    assert not isinstance(half.layers[1], FusedDecodeBlock)
    assert isinstance(half.layers[0].attention.wqkv, QuantLinear)
    attach(stored, None)
    assert not any(isinstance(layer, FusedDecodeBlock) for layer in stored.layers)
