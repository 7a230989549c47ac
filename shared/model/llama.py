"""Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache, as the equations.

Tokens arrive packed over the batch: ``input_ids`` and ``positions`` are (T,), and every layer
writes its new K/V into ``kv_pool.layer(i)`` and attends through ``paged_attention``. q/k/v share one
projection and gate/up share another (fused at load time); on CPU the fewer, larger matmuls matter.

Each module's ``forward`` is the math in torch and chooses no kernel. The engine's backend
(``backend.py``) picks the kernels once, when the engine is built: the CPU one
(``cpu_backend.py``) installs its C-kernel subclasses of these modules (and of
``quant_layers``'), and plans each decode step before the pass; Triton's attention on CUDA is
``paged_attention``'s, chosen by the metadata the engine builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.model.attention import AttentionMetadata, paged_attention
from kvmesh.shared.model.config import ModelConfig
from kvmesh.shared.model.quant_layers import QuantEmbedding
from kvmesh.shared.model.rope import apply_rope, rope_cos_sin, rotation_tables
from torch import nn


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
    """x / sqrt(mean(x^2) + eps) * weight"""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as the reference does). In-place where
        # the tensor is our own: at prefill sizes each fresh allocation costs page faults.
        h = x.float()
        h = h * h.square().mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return h.to(x.dtype).mul_(self.weight)


class Linear(nn.Linear):
    """x @ W.T (+ b): ``nn.Linear`` whose (out, in) weight is stored column-major, i.e. as a
    contiguous (in, out) matrix seen through ``.t()``. ``F.linear`` then multiplies by that
    contiguous matrix, which MKL runs faster on CPU (10-40% for one-token GEMV, ~10% at 32 rows).
    Shapes and state dicts are those of ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self.weight = nn.Parameter(self.weight.detach().t().contiguous().t())


class SiluAndMul(nn.Module):
    """[gate | up] (rows, 2n) -> silu(gate) * up (rows, n)"""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate).mul_(up)


class RotaryPagedAttention(nn.Module):
    """Layer ``layer_idx``'s attention of packed heads qkv (T, H_q + 2 H_kv, D):
    q, k = rope(q), rope(k); store k, v in the new tokens' slots; softmax(q K^T * scale) V over
    each sequence's context, read through its block table. Returns (T, H_q, D)."""

    def __init__(self, layer_idx: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.scale = scale

    def forward(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_q_heads: int,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        H_q = num_q_heads
        H_kv = (qkv.shape[1] - H_q) // 2
        qk = apply_rope(qkv[:, : H_q + H_kv], cos, sin)  # q and k heads rotated in one go
        q, k, v = qk[:, :H_q], qk[:, H_q:], qkv[:, H_q + H_kv :]  # (T, H_q, D), (T, H_kv, D) x 2
        k_cache, v_cache = kv_pool.layer(self.layer_idx)
        kv_scales = kv_pool.layer_scales(self.layer_idx)  # None unless fp8 or int8
        return paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, kv_scales)


class Attention(nn.Module):
    """Wo attend(Wqkv x)"""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.wqkv = Linear(
            config.hidden_size, self.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.attend = RotaryPagedAttention(layer_idx, config.head_dim**-0.5)
        self.wo = Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.wqkv(x).view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        out = self.attend(qkv, cos, sin, self.num_heads, kv_pool, meta)  # (T, H_q, D)
        return self.wo(out.reshape(T, self.q_size))


class FeedForward(nn.Module):
    """W_down (silu(W_gate x) * W_up x)"""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.w_gate_up = Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.act = SiluAndMul()
        self.w_down = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(self.act(self.w_gate_up(x)))


class TransformerBlock(nn.Module):
    """h = x + attention(norm(x)); out = h + feed_forward(norm(h))"""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = Attention(config, layer_idx)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.attention(self.attention_norm(x), cos, sin, kv_pool, meta).add_(x)
        return self.feed_forward(self.ffn_norm(h)).add_(h)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a weight on the meta device uninitialised: the loader builds
    the model there and fills every weight from the checkpoint, and torch's meta ``normal_``
    imports torch._dynamo (with triton and sympy), seconds of every worker's start-up."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab): hidden @ w.T (a tied LM head; the CPU backend's reads w in
        place, ``cpu_modules.CpuEmbedding``)."""
        return F.linear(hidden, self.weight)


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
        if self.output is None and isinstance(self.tok_embeddings, (Embedding, QuantEmbedding)):
            return self.tok_embeddings.project(hidden).float()
        if self.output is not None and not isinstance(self.output, Linear):
            return self.output(hidden).float()  # as stored, or split (tensor_parallel.py)
        return F.linear(hidden, self.lm_head_weight).float()
