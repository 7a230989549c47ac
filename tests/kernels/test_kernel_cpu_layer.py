"""kernels/cpu_layer.c: one decoder layer's decode step in one C call, against the same layer run
module by module (torch, and the separate C kernels), and its fall-backs."""

import dataclasses

import pytest
import torch
from kvmesh.shared.model.cpu_modules import FusedDecodeBlock
from support.cpu_layers import attach, decode_step, layer_config, random_model, run_step_ways


@pytest.mark.parametrize(
    ("hidden", "inter", "heads", "kv_heads", "head_dim", "bias", "context_lens"),
    [
        (64, 128, 4, 2, 16, False, [5]),  # batch 1: the paired-panel linear path
        (40, 36, 4, 2, 10, False, [1, 17, 40]),  # partial panels in every linear layer
        (48, 72, 6, 3, 8, True, [16, 3, 33, 9, 70]),  # biases (Qwen2), a group of 2
        (32, 64, 2, 1, 16, False, list(range(1, 41))),  # more rows than one row block tile
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_decode_layer_matches_module_path(
    ops, hidden, inter, heads, kv_heads, head_dim, bias, context_lens, threads
):
    config = layer_config(hidden, inter, heads, kv_heads, head_dim, bias)
    model = random_model(config)
    runs = run_step_ways(model, ops, decode_step(config, context_lens), threads, reference=model)
    # the same kernels in the same order: bit for bit the separate C calls
    assert torch.equal(runs.fused, runs.unfused)
    assert torch.equal(runs.fused_pool.tensor, runs.unfused_pool.tensor)
    torch.testing.assert_close(runs.fused, runs.reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        runs.fused_pool.tensor, runs.reference_pool.tensor, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("threads", "context_lens"), [(1, [16, 3, 33, 70]), (2, [500]), (3, [500, 40])]
)
def test_fused_decode_layer_over_half_caches_and_long_contexts(
    ops, kv_dtype, threads, context_lens
):
    """A float16 or bfloat16 KV pool beside float32 weights: the fused layer stores and reads it
    as the separate C kernels do (bit for bit) and as torch does (its cast, its upcast). A
    context of several chunks (256 positions) is split over the threads chunk by chunk where the
    separate kernels give each thread whole (sequence, KV head) units: the same result bit for
    bit (500 tokens and 3 KV heads at batch 1: 6 chunks, cut between threads)."""
    config = layer_config(48, 72, 6, 3, 16, False)
    model = random_model(config)
    step = decode_step(config, context_lens, kv_dtype=kv_dtype)
    runs = run_step_ways(model, ops, step, threads, reference=model)
    assert runs.fused_pool.tensor.dtype == kv_dtype
    assert torch.equal(runs.fused, runs.unfused)
    assert torch.equal(runs.fused_pool.tensor, runs.unfused_pool.tensor)
    # (a new K/V value that rounds to the neighbouring half moves the output a little more)
    tol = 1e-4 if kv_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(runs.fused, runs.reference, rtol=tol, atol=tol)
    # the new K/V: the C and torch linear layers differ in their last float32 bits, which a
    # 16-bit rounding may carry one step of the 16-bit grid
    grid = {torch.float16: 2**-10, torch.bfloat16: 2**-7}.get(kv_dtype, 1e-5)
    torch.testing.assert_close(
        runs.fused_pool.tensor.float(), runs.reference_pool.tensor.float(), rtol=grid, atol=1e-5
    )


def test_fused_decode_layer_is_attached_only_where_every_part_is_packed(ops):
    config = layer_config(32, 64, 2, 1, 16, False)
    model = random_model(config)
    attach(model, ops)
    assert all(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    model.to(torch.float64)
    attach(model, ops)  # float64 weights are not packed: the layers run module by module
    assert not any(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    attach(model, None)
    assert not any(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    assert not any(hasattr(m, "ops") or hasattr(m, "packed") for m in model.modules())


def test_fused_decode_layer_steps_aside_for_prefill_chunks(ops, monkeypatch):
    config = layer_config(32, 64, 2, 1, 16, False)
    model = random_model(config)
    pool, meta, input_ids, _ = decode_step(config, [4, 9])
    prefill = dataclasses.replace(meta, query_lens=[2])  # one sequence, two new tokens
    prefill = dataclasses.replace(
        prefill, context_lens=meta.context_lens[:1] + 1, block_tables=meta.block_tables[:1]
    )
    calls = []
    monkeypatch.setattr(type(ops), "decode_layer", lambda *a: calls.append(a))
    backend = attach(model, ops)
    ids, positions = input_ids, torch.tensor([3, 4])
    slots = torch.cat([meta.slot_mapping[:1], meta.slot_mapping[:1] + 1])
    prefill = dataclasses.replace(prefill, slot_mapping=slots)
    assert backend.plan_step(prefill, pool) is None  # a prefill chunk: no C decode step
    with torch.no_grad():
        model(ids, positions, pool, prefill)
    attach(model, None)
    assert calls == []
