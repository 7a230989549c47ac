"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

Tokens arrive packed over the batch: ``input_ids`` and ``positions`` are (T,), and every layer
writes its new K/V into ``kv_pool.layer(i)`` and attends through ``paged_attention``. q/k/v share one
projection and gate/up share another (fused at load time); on CPU the fewer, larger matmuls matter.

``attach_cpu_ops`` routes float32 decode-sized work on the CPU through the C kernels of
``kernels/``: RMSNorm, SiLU-and-multiply, linear layers over prepacked weights, and rotary + KV
store + attention in one call; without them every module runs the pure-torch code below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from kvmesh.kernels.cpu_ops import (
    DecodeLayerKV,
    DecodeLayerWeights,
    QuantDecodeLayerWeights,
    decode_plan,
    pack_linear_weight,
)
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.quant import pair_blocks, unpair_blocks
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
from kvmesh.shared.model.rope import apply_rope, rope_cos_sin, rotation_tables
from torch import nn

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_ops import CpuOps, DecodePlan, PackedWeight

# Row counts up to which the C kernels take RMSNorm and SiLU-and-multiply: they save torch's
# per-op dispatch, which dominates at decode sizes; at prefill sizes torch's own vectorised ops
# are faster (SiLU-and-multiply of 2048 x 1408: 7 ms against 19 ms on one core) and may spread
# over several threads.
CPU_OPS_MAX_ROWS = 256
# Row counts up to which a linear layer multiplies by its prepacked weight (``CpuOps.linear``):
# decode batches, bound by reading the weights; above it MKL's blocked GEMM computes faster.
PACKED_LINEAR_MAX_ROWS = 64
# KV caches the C decode attention reads: float32, float16, bfloat16, fp8 e4m3 and int8 with
# scales (kv_quant.py, kv_int8.py)
CPU_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)


def _cpu_ops_sized(x: torch.Tensor) -> bool:
    """Whether the elementwise C kernels take ``x``: float32, (rows, n) contiguous, decode-sized."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] <= CPU_OPS_MAX_ROWS
        and x.is_contiguous()
    )


def kv_cache_spec(
    config: ModelConfig, block_size: int = 16, dtype: torch.dtype | None = None
) -> KVCacheSpec:
    """The KV cache shape this model needs; ``dtype`` defaults to the model's dtype."""
    return KVCacheSpec(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=config.torch_dtype if dtype is None else dtype,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.cpu_ops: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and _cpu_ops_sized(x):
            return self.cpu_ops.rms_norm(x, self.weight, self.eps)
        # Normalise in float32, scale in the model dtype (as the reference does). In-place where
        # the tensor is our own: at prefill sizes each fresh allocation costs page faults.
        h = x.float()
        h = h * h.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return h.to(x.dtype).mul_(self.weight)


class Linear(nn.Linear):
    """``nn.Linear`` whose (out, in) weight is stored column-major, i.e. as a contiguous (in, out)
    matrix seen through ``.t()``. ``F.linear`` then multiplies by that contiguous matrix, which
    MKL runs faster on CPU (10-40% for one-token GEMV, ~10% at 32 rows). Shapes and state dicts
    are those of ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(self.weight.detach().t().contiguous().t())
        self.cpu_ops: CpuOps | None = None
        self.packed: PackedWeight | None = None  # set with cpu_ops by attach_cpu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.packed is not None
            and x.dim() == 2
            and x.shape[0] <= PACKED_LINEAR_MAX_ROWS
            and x.dtype == torch.float32
            and x.is_contiguous()
        ):
            return self.cpu_ops.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.scale = config.head_dim**-0.5
        self.wqkv = Linear(
            config.hidden_size, self.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.wo = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        self.cpu_ops: CpuOps | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        H_q, H_kv = self.num_heads, self.num_kv_heads
        qkv = self.wqkv(x).view(T, H_q + 2 * H_kv, self.head_dim)
        k_cache, v_cache = kv_pool.layer(self.layer_idx)
        kv_scales = kv_pool.layer_scales(self.layer_idx)  # None unless fp8 or int8
        ops = self.cpu_ops
        if (
            ops is not None
            and qkv.dtype == torch.float32
            and k_cache.dtype in CPU_KV_DTYPES
            and meta.is_decode_only
            and not meta.use_triton
        ):
            if meta.cpu_plan is None:  # once per step, for every layer
                meta.cpu_plan = _decode_plan(meta, k_cache, H_q // H_kv, kv_scales is not None)
            out = ops.decode_attention(
                qkv,
                cos,
                sin,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                H_q,
                self.scale,
                meta.cpu_plan,
                kv_scales,
            )
            return self.wo(out.view(T, self.q_size))
        qk = apply_rope(qkv[:, : H_q + H_kv], cos, sin)  # q and k heads rotated in one go
        q, k, v = qk[:, :H_q], qk[:, H_q:], qkv[:, H_q + H_kv :]  # (T, H_q, D), (T, H_kv, D) x 2
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kv_scales)  # (T, H_q, D)
        return self.wo(out.reshape(T, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.cpu_ops: CpuOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.w_gate_up(x)
        if self.cpu_ops is not None and _cpu_ops_sized(gate_up):
            return self.w_down(self.cpu_ops.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.w_down(F.silu(gate).mul_(up))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)
        # set by attach_cpu_ops where every part of the layer can run in CpuOps.decode_layer
        # (float32 weights) or CpuOps.decode_layer_quant (weights as stored)
        self.cpu_ops: CpuOps | None = None
        self.decode_weights: DecodeLayerWeights | QuantDecodeLayerWeights | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.decode_weights is not None and _is_fusable_decode(x, meta):
            k_cache, v_cache = kv_pool.layer(self.attention.layer_idx)
            if k_cache.dtype in CPU_KV_DTYPES and k_cache.is_cpu:
                scales = kv_pool.layer_scales(self.attention.layer_idx)
                return self._fused_decode(x, cos, sin, k_cache, v_cache, meta, scales)
        h = self.attention(self.attention_norm(x), cos, sin, kv_pool, meta).add_(x)
        return self.feed_forward(self.ffn_norm(h)).add_(h)

    def _fused_decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The whole layer in one C call (``CpuOps.decode_layer``, or ``decode_layer_quant`` for
        weights as stored), the same arithmetic as the per-module C kernels."""
        w = self.decode_weights
        if meta.cpu_plan is None:  # once per step, for every layer
            group = w.num_q_heads // w.num_kv_heads
            meta.cpu_plan = _decode_plan(meta, k_cache, group, scales is not None)
        kv = DecodeLayerKV(
            k_cache, v_cache, cos, sin, meta.block_tables, meta.context_lens, meta.cpu_plan, scales
        )
        if isinstance(w, QuantDecodeLayerWeights):
            return self.cpu_ops.decode_layer_quant(x, w, kv)
        return self.cpu_ops.decode_layer(x, w, kv)


def _decode_plan(
    meta: AttentionMetadata, k_cache: torch.Tensor, group: int, is_quantized: bool
) -> DecodePlan:
    """The step's ``DecodePlan`` (made by the first layer, shared by all)."""
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    width = meta.block_tables.shape[1]
    quant_head_dim = head_dim if is_quantized else 0
    return decode_plan(
        meta.context_lens,
        width,
        block_size,
        group,
        quant_head_dim=quant_head_dim,
        tree_rows=meta.tree_rows,
        head_dim=head_dim,
    )


def _is_fusable_decode(x: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether a layer's input can take the fused C decode layer: a float32 (rows, hidden)
    contiguous CPU batch of one new token per sequence, decode-sized, not on the Triton path."""
    return (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] <= PACKED_LINEAR_MAX_ROWS
        and x.is_contiguous()
        and x.is_cpu
        and meta.is_decode_only
        and not meta.use_triton
    )


class Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a weight on the meta device uninitialised: the loader builds
    the model there and fills every weight from the checkpoint, and torch's meta ``normal_``
    imports torch._dynamo (with triton and sympy), seconds of every worker's start-up."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Transformer(nn.Module):
    """The decoder. ``model(input_ids, positions, kv_pool, meta) -> (T, hidden_size)``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.output = None
        if not config.tie_word_embeddings:
            self.output = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.reset_rope_cache()

    def reset_rope_cache(self) -> None:
        """(Re)build the rotation tables (``rotation_tables``), (max_position_embeddings, head_dim)
        float32, on the model's device. Call after materialising a model built on the meta device."""
        device = self.norm.weight.device
        num_positions = self.config.max_position_embeddings
        if device.type == "meta":  # shapes only; the loader calls this again once materialised
            shape = (num_positions, self.config.head_dim)
            self.rope_cos, self.rope_sin = (
                torch.empty(shape, device=device),
                torch.empty(shape, device=device),
            )
            return
        cos, sin = rotation_tables(*rope_cos_sin(self.config, num_positions))
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: (T,) packed over the batch. Returns hidden states (T, hidden_size)."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1, (
            input_ids.shape,
            positions.shape,
        )
        x = self.tok_embeddings(input_ids)  # (T, hidden)
        cos = self.rope_cos.index_select(0, positions).to(x.dtype).unsqueeze(1)  # (T, 1, D)
        sin = self.rope_sin.index_select(0, positions).to(x.dtype).unsqueeze(1)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_pool, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32."""
        if self.output is None and isinstance(self.tok_embeddings, QuantEmbedding):
            return self.tok_embeddings.project(hidden).float()
        if self.output is not None and not isinstance(self.output, Linear):
            return self.output(hidden).float()  # as stored, or split (tensor_parallel.py)
        return F.linear(hidden, self.lm_head_weight).float()


def attach_cpu_ops(model: Transformer, ops: CpuOps | None) -> None:
    """Route the float32 decode-sized work of every layer through ``ops``; None restores the
    pure-torch path. Each module still checks dtype and shape on every call and falls back.

    Float32 linear layers also get a packed copy of their weight (``pack_linear_weight``; as much
    memory again as the layers' weights) for decode-sized batches: attach after the weights are
    final, a later ``load_state_dict`` does not reach the copy. The layers' Q4 weights kept as
    stored are rewritten in place in the kernels' paired layout where ``ops`` reads it
    (``quant.pair_blocks``: the same bytes, the same values, faster to unpack)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, Attention, FeedForward)):
            module.cpu_ops = ops
        if isinstance(module, QuantLinear):  # weights as stored: CpuOps.quant_linear
            module.cpu_ops = ops if module.qweight.data.is_cpu else None
        if isinstance(module, Linear):
            is_packable = ops is not None and module.weight.dtype == torch.float32
            is_packable = is_packable and module.weight.device.type == "cpu"
            module.cpu_ops = ops if is_packable else None
            module.packed = pack_linear_weight(module.weight.detach()) if is_packable else None
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            for linear in module.modules():  # Q4 in the layout ops reads (paired: faster)
                if isinstance(linear, QuantLinear) and linear.cpu_ops is not None:
                    w = linear.qweight  # rewritten in place: no second copy stays resident
                    linear.qweight = (
                        pair_blocks(w, in_place=True)
                        if linear.cpu_ops.quant_pairs
                        else unpair_blocks(w)
                    )
            module.cpu_ops = ops
            module.decode_weights = None if ops is None else _decode_layer_weights(module)


def _decode_layer_weights(
    block: TransformerBlock,
) -> DecodeLayerWeights | QuantDecodeLayerWeights | None:
    """The fused decode layer's view of a block whose norms are float32 on the CPU and whose
    linear layers are all packed (float32) or all kept as stored on the CPU; None where any part
    is not (the block then runs module by module)."""
    attn, ffn = block.attention, block.feed_forward
    linears = (attn.wqkv, attn.wo, ffn.w_gate_up, ffn.w_down)
    norms = (block.attention_norm, block.ffn_norm)
    if block.attention_norm.eps != block.ffn_norm.eps:
        return None
    if any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
        return None
    if all(isinstance(linear, QuantLinear) for linear in linears):
        if any(linear.cpu_ops is None for linear in linears):
            return None
        layout: type[DecodeLayerWeights | QuantDecodeLayerWeights] = QuantDecodeLayerWeights
        weights = [linear.qweight for linear in linears]
    elif all(isinstance(linear, Linear) and linear.packed is not None for linear in linears):
        layout, weights = DecodeLayerWeights, [linear.packed for linear in linears]
    else:
        return None

    def bias(linear: Linear | QuantLinear) -> torch.Tensor | None:
        return None if linear.bias is None else linear.bias.detach().float().contiguous()

    return layout(
        hidden=block.attention_norm.weight.shape[0],
        inter=ffn.intermediate_size,
        num_q_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        eps=block.attention_norm.eps,
        scale=attn.scale,
        attn_norm=block.attention_norm.weight.detach().contiguous(),
        ffn_norm=block.ffn_norm.weight.detach().contiguous(),
        wqkv=weights[0],
        bqkv=bias(attn.wqkv),
        wo=weights[1],
        bo=bias(attn.wo),
        w_gate_up=weights[2],
        b_gate_up=bias(ffn.w_gate_up),
        w_down=weights[3],
        b_down=bias(ffn.w_down),
    )
