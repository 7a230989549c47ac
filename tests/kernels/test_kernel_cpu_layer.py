"""kernels/cpu_layer.c: one decoder layer's decode step in one C call, against the same layer run
module by module (torch, and the separate C kernels), and its fall-backs."""

import dataclasses

import pytest
import torch
from kvmesh.kernels.cpu_ops import load_cpu_ops
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model.attention import AttentionMetadata
from kvmesh.shared.model.backend import CpuBackend, TorchBackend
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.cpu_modules import FusedDecodeBlock
from kvmesh.shared.model.llama import Transformer, kv_cache_spec


@pytest.fixture(scope="module")
def ops():
    ops = load_cpu_ops()
    assert ops is not None, "gcc is part of the test machine; the C kernels must build"
    return ops


def _config(hidden, inter, heads, kv_heads, head_dim, bias):
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=50,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=bias,
        bos_token_id=0,
        eos_token_ids=(1,),
        dtype=torch.float32,
        source="test",
    )


def _model(config, seed=0):
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        for layer in model.layers:  # norms near one, as trained models have them
            layer.attention_norm.weight.add_(1.0)
            layer.ffn_norm.weight.add_(1.0)
    return model


def _decode_step(config, context_lens, block_size=16, seed=0, kv_dtype=None):
    """A pool holding each sequence's earlier tokens, and a decode step's inputs and metadata."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in context_lens)
    num_blocks = len(context_lens) * width + 2
    pool = KVPool(kv_cache_spec(config, block_size, kv_dtype), num_blocks)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=g))
    ids = torch.randperm(num_blocks, generator=g)[: len(context_lens) * width]
    tables = ids.view(len(context_lens), width).contiguous()
    ctx = torch.tensor(context_lens)
    pos = ctx - 1
    slots = tables.gather(1, (pos // block_size)[:, None]).squeeze(1) * block_size
    slots += pos % block_size
    meta = AttentionMetadata(slots, [1] * len(context_lens), ctx, tables, block_size)
    input_ids = torch.randint(0, config.vocab_size, (len(context_lens),), generator=g)
    return pool, meta, input_ids, pos


def attach(model, ops, fused=True):
    """Install ``ops``' backend on ``model`` (None: the torch one); returns it."""
    backend = TorchBackend() if ops is None else CpuBackend(ops, fuse_layers=fused)
    backend.install(model)
    return backend


def _run(model, ops, pool, meta, input_ids, pos, fused=True):
    """The model's hidden states after one decode step with ``ops`` attached (None: torch)."""
    backend = attach(model, ops, fused)
    own = KVPool(pool.spec, pool.num_blocks)
    own.tensor.copy_(pool.tensor)
    meta = dataclasses.replace(meta, cpu_plan=backend.plan_step(meta, own))
    with torch.no_grad():
        return model(input_ids, pos, own, meta), own


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
    config = _config(hidden, inter, heads, kv_heads, head_dim, bias)
    model = _model(config)
    pool, meta, input_ids, pos = _decode_step(config, context_lens)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, fused_pool = _run(model, ops, pool, meta, input_ids, pos)
        unfused, unfused_pool = _run(model, ops, pool, meta, input_ids, pos, fused=False)
        reference, reference_pool = _run(model, None, pool, meta, input_ids, pos)
    finally:
        torch.set_num_threads(saved)
        attach(model, None)
    # the same kernels in the same order: bit for bit the separate C calls
    assert torch.equal(fused, unfused)
    assert torch.equal(fused_pool.tensor, unfused_pool.tensor)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused_pool.tensor, reference_pool.tensor, rtol=1e-5, atol=1e-5)


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
    config = _config(48, 72, 6, 3, 16, False)
    model = _model(config)
    pool, meta, input_ids, pos = _decode_step(config, context_lens, kv_dtype=kv_dtype)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, fused_pool = _run(model, ops, pool, meta, input_ids, pos)
        unfused, unfused_pool = _run(model, ops, pool, meta, input_ids, pos, fused=False)
        reference, reference_pool = _run(model, None, pool, meta, input_ids, pos)
    finally:
        torch.set_num_threads(saved)
        attach(model, None)
    assert fused_pool.tensor.dtype == kv_dtype
    assert torch.equal(fused, unfused)
    assert torch.equal(fused_pool.tensor, unfused_pool.tensor)
    # (a new K/V value that rounds to the neighbouring half moves the output a little more)
    tol = 1e-4 if kv_dtype == torch.float32 else 1e-3
    torch.testing.assert_close(fused, reference, rtol=tol, atol=tol)
    # the new K/V: the C and torch linear layers differ in their last float32 bits, which a
    # 16-bit rounding may carry one step of the 16-bit grid
    step = {torch.float16: 2**-10, torch.bfloat16: 2**-7}.get(kv_dtype, 1e-5)
    torch.testing.assert_close(
        fused_pool.tensor.float(), reference_pool.tensor.float(), rtol=step, atol=1e-5
    )


def test_fused_decode_layer_is_attached_only_where_every_part_is_packed(ops):
    config = _config(32, 64, 2, 1, 16, False)
    model = _model(config)
    attach(model, ops)
    assert all(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    model.to(torch.float64)
    attach(model, ops)  # float64 weights are not packed: the layers run module by module
    assert not any(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    attach(model, None)
    assert not any(isinstance(layer, FusedDecodeBlock) for layer in model.layers)
    assert not any(hasattr(m, "ops") or hasattr(m, "packed") for m in model.modules())


def test_fused_decode_layer_steps_aside_for_prefill_chunks(ops, monkeypatch):
    config = _config(32, 64, 2, 1, 16, False)
    model = _model(config)
    pool, meta, input_ids, _ = _decode_step(config, [4, 9])
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
