"""Small random Llama models and one decode step run on them with the CPU kernels attached: the
fused C layer, the same C kernels module by module, and torch (tests/kernels/test_kernel_cpu_layer*.py,
test_kernel_cpu_kquant.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata
from kvmesh.shared.model.backend import CpuBackend, TorchBackend
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.llama import Transformer, kv_cache_spec
from kvmesh.shared.model.quant import dequantize
from kvmesh.shared.model.quant_layers import use_quant_weights

LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w_gate_up", "feed_forward.w_down")


def layer_config(hidden, inter, heads, kv_heads, head_dim, bias) -> ModelConfig:
    """Two float32 layers of these sizes, biases on every linear layer or on none."""
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


def random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        for layer in model.layers:  # norms near one, as trained models have them
            layer.attention_norm.weight.add_(1.0)
            layer.ffn_norm.weight.add_(1.0)
    return model


def quantized_twins(
    config: ModelConfig, stored_weight: Callable[[str, torch.Tensor], Any]
) -> tuple[Transformer, Transformer]:
    """The same random model twice: its LINEARS' weights as ``stored_weight(name, weight)``
    stores them, and as the float32 values those hold."""
    stored, floats = random_model(config), random_model(config)
    weights = {}
    for i, layer in enumerate(stored.layers):
        for name in LINEARS:
            weight = layer.get_submodule(name).weight.detach()
            weights[f"layers.{i}.{name}.weight"] = stored_weight(name, weight)
    with torch.no_grad():
        for name, weight in weights.items():
            floats.get_parameter(name).copy_(dequantize(weight))
    use_quant_weights(stored, weights)
    return stored, floats


def random_cache(spec: KVCacheSpec, context_lens, generator, spare_blocks: int):
    """A pool of random values drawn from ``generator``, and each sequence's block table:
    distinct shuffled blocks, as many as the longest of ``context_lens`` needs, and
    ``spare_blocks`` blocks no table holds."""
    width = max(-(-c // spec.block_size) for c in context_lens)
    num_blocks = len(context_lens) * width + spare_blocks
    pool = KVPool(spec, num_blocks)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=generator))
    ids = torch.randperm(num_blocks, generator=generator)[: len(context_lens) * width]
    return pool, ids.view(len(context_lens), width).contiguous()


def decode_step(config, context_lens, block_size=16, seed=0, kv_dtype=None):
    """A pool holding each sequence's earlier tokens, and a decode step's inputs and metadata."""
    g = torch.Generator().manual_seed(seed)
    spec = kv_cache_spec(config, block_size, kv_dtype)
    pool, tables = random_cache(spec, context_lens, g, spare_blocks=2)
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


def run_step(model, ops, pool, meta, input_ids, pos, fused=True):
    """The model's hidden states after one decode step with ``ops`` attached (None: torch), and
    the step's own copy of ``pool``."""
    backend = attach(model, ops, fused)
    own = KVPool(pool.spec, pool.num_blocks)
    own.tensor.copy_(pool.tensor)
    meta = dataclasses.replace(meta, cpu_plan=backend.plan_step(meta, own))
    with torch.no_grad():
        return model(input_ids, pos, own, meta), own


@dataclasses.dataclass(frozen=True, slots=True)
class StepRuns:
    """One decode step's hidden states and pools: ``fused`` (the C layer), ``unfused`` (the C
    kernels module by module), ``reference`` (torch; None where not run); ``fused_weights``:
    each layer's packed weights in the fused run (None: that layer ran module by module)."""

    fused: torch.Tensor
    fused_pool: KVPool
    fused_weights: tuple[Any, ...]
    unfused: torch.Tensor
    unfused_pool: KVPool
    reference: torch.Tensor | None
    reference_pool: KVPool | None


def run_step_ways(model, ops, step, threads, reference=None) -> StepRuns:
    """``step`` (decode_step's answer) on ``model`` fused and unfused with ``ops`` on ``threads``
    torch threads, and on ``reference`` with torch (None: not run); ``model`` is left on torch."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused, fused_pool = run_step(model, ops, *step)
        fused_weights = tuple(getattr(layer, "weights", None) for layer in model.layers)
        unfused, unfused_pool = run_step(model, ops, *step, fused=False)
        ref, ref_pool = run_step(reference, None, *step) if reference is not None else (None, None)
    finally:
        torch.set_num_threads(saved)
        attach(model, None)
    return StepRuns(fused, fused_pool, fused_weights, unfused, unfused_pool, ref, ref_pool)
