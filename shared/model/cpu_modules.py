"""The C kernels (``kernels/cpu_ops.py``) as subclasses of the model's modules.

Each class here computes its module's function with a ``CpuOps`` kernel on the inputs that
kernel is built and fast for, and with the torch math of the class it subclasses (``llama.py``,
``quant_layers.py``) on all others: the row counts are the kernels' own sizing, not a choice of
path. ``CpuBackend`` (``cpu_backend.py``) installs them once per engine by setting a module's
class (as ``torch.nn.utils.parametrize`` does), so parameters, state-dict keys and references to
the modules stay as they are, and ``remove_cpu_kernels`` sets the classes back. The fused decoder
layer and the C decode attention run only on a step the backend planned (``meta.cpu_plan``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from kvmesh.kernels.cpu_plans import (
    DecodeLayerKV,
    DecodeLayerWeights,
    PackedWeight,
    QuantDecodeLayerWeights,
)
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model.attention import AttentionMetadata
from kvmesh.shared.model.llama import (
    Embedding,
    Linear,
    RMSNorm,
    RotaryPagedAttention,
    SiluAndMul,
    TransformerBlock,
)
from kvmesh.shared.model.quant import FLOAT_FORMATS, QuantWeight, StackedWeight
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
from torch import nn

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_bindings import CpuOps

# Row counts up to which the C kernels take RMSNorm and SiLU-and-multiply: they save torch's
# per-op dispatch, which dominates at decode sizes; at prefill sizes torch's own vectorised ops
# are faster (SiLU-and-multiply of 2048 x 1408: 7 ms against 19 ms on one core) and may spread
# over several threads.
CPU_OPS_MAX_ROWS = 256
# Row counts up to which a linear layer multiplies by its prepacked weight (``CpuOps.linear``),
# and the fused decoder layer takes a decode batch: bound by reading the weights; above it MKL's
# blocked GEMM computes faster.
PACKED_LINEAR_MAX_ROWS = 64
# From this many rows on (a prefill chunk) a weight kept as stored is dequantized and multiplied
# in float: the dequantization is paid once for all the rows, the GEMM runs at float speed, and
# the prompt's activations keep their precision. Decode's few rows take the kernel (int8
# activations), where reading the weight as stored is the whole cost. SmolLM2's greedy answer to
# the README's question turns on small margins that int8 activations in the prompt's layers
# flip (issue 41).
FLOAT_GEMM_ROWS = 16


def _fits(x: torch.Tensor, max_rows: int) -> bool:
    """Whether a kernel over (rows, n) float32 contiguous input takes ``x``."""
    return (
        x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] <= max_rows and x.is_contiguous()
    )


def _is_kernel_input(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and x.is_contiguous()


class CpuKernel:
    """A module computing with ``ops``; ``torch_class`` is the class it was installed over and
    ``kernel_attrs`` what installing it added (dropped again by ``remove_cpu_kernels``)."""

    torch_class: ClassVar[type[nn.Module]]
    kernel_attrs: ClassVar[tuple[str, ...]] = ("ops",)
    ops: CpuOps

    @classmethod
    def install(cls, module: nn.Module, ops: CpuOps, **attrs: object) -> None:
        assert type(module) is cls.torch_class, (type(module), cls)
        module.__class__ = cls
        module.__dict__.update(ops=ops, **attrs)


def remove_cpu_kernels(model: nn.Module) -> None:
    """Every module of ``model`` back to its torch class, without what the kernels added (the
    packed weights: as much memory again as the float layers')."""
    for module in model.modules():
        if isinstance(module, CpuKernel):
            for name in module.kernel_attrs:
                module.__dict__.pop(name, None)
            module.__class__ = module.torch_class


class CpuRMSNorm(CpuKernel, RMSNorm):
    torch_class = RMSNorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fits(x, CPU_OPS_MAX_ROWS):
            return self.ops.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class CpuSiluAndMul(CpuKernel, SiluAndMul):
    torch_class = SiluAndMul

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if _fits(gate_up, CPU_OPS_MAX_ROWS):
            return self.ops.silu_mul(gate_up)
        return super().forward(gate_up)


class PackedLinear(CpuKernel, Linear):
    """A float32 CPU ``Linear`` with a packed copy of its weight (``pack_linear_weight``) for
    decode-sized batches (``CpuOps.linear``). A later ``load_state_dict`` does not reach the copy:
    install after the weights are final."""

    torch_class = Linear
    kernel_attrs = ("ops", "packed")
    packed: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fits(x, PACKED_LINEAR_MAX_ROWS):
            return self.ops.linear(x, self.packed, self.bias)
        return super().forward(x)


class CpuEmbedding(CpuKernel, Embedding):
    """A float32 tied LM head read in place for decode rows (``CpuOps.linear_rows``): no packed
    copy of a model's largest weight (SmolLM2's 113 MB), and torch's GEMV read it at 10 GB/s at
    one row and 4-5 GB/s at 2-8 rows on one Zen core, the kernel at ~25 and ~10-22."""

    torch_class = Embedding

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if _fits(hidden, PACKED_LINEAR_MAX_ROWS) and w.dtype == torch.float32 and w.is_contiguous():
            return self.ops.linear_rows(hidden, w.detach())
        return super().project(hidden)


class CpuQuantLinear(CpuKernel, QuantLinear):
    """A weight kept as stored, on the CPU: ``CpuOps.quant_linear`` (the weight read as stored,
    the activations quantized per block of 32 to int8 for a block format, float32 for F16 and
    BF16) for decode rows, the float GEMM from ``FLOAT_GEMM_ROWS`` on."""

    torch_class = QuantLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _is_kernel_input(x):
            return super().forward(x)
        if x.shape[0] < FLOAT_GEMM_ROWS:
            return self.ops.quant_linear(x, self.qweight, self.bias)
        return F.linear(x, self.ops.dequantize(self.qweight), self.bias)  # torch's values, in C


class CpuQuantEmbedding(CpuKernel, QuantEmbedding):
    """A tied LM head as stored: its logits with the activations quantized twice
    (``residual_quant_linear``): the logits' margins are what greedy decoding turns on, and one
    int8 pass flips small ones (issue 41). An F16 or BF16 head reads the activations as float32:
    one pass, through its ``head``."""

    torch_class = QuantEmbedding

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if not _is_kernel_input(hidden) or self.qweight.format in FLOAT_FORMATS:
            return super().project(hidden)
        return residual_quant_linear(self.ops, hidden, self.qweight)


def residual_quant_linear(
    ops: CpuOps, x: torch.Tensor, weight: QuantWeight | StackedWeight
) -> torch.Tensor:
    """x @ w.T with x's int8 rounding error itself multiplied in: y = W q(x) + W q(x - q(x)),
    where q is the kernels' per-block int8 quantization. The two terms are about 16-bit
    activations, the weight still read as stored. x and its residual go through the kernel as
    one batch of twice the rows, so the weight is read once (each row's result does not depend
    on the others). x: (rows, in) float32 contiguous."""
    from kvmesh.kernels.cpu_references import quantize_activations_reference

    qx, dx = quantize_activations_reference(x)
    residual = x - (qx * dx.unsqueeze(-1)).reshape(x.shape)
    both = ops.quant_linear(torch.cat([x, residual]), weight)
    rows = x.shape[0]
    return both[:rows] + both[rows:]


class CpuDecodeAttention(CpuKernel, RotaryPagedAttention):
    """On a planned decode step (one new token per sequence, float32 queries): rotary, KV store
    and attention in one C call (``CpuOps.decode_attention``) with the step's plan."""

    torch_class = RotaryPagedAttention

    def forward(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_q_heads: int,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        plan = meta.cpu_plan
        if plan is None or qkv.dtype != torch.float32:
            return super().forward(qkv, cos, sin, num_q_heads, kv_pool, meta)
        k_cache, v_cache = kv_pool.layer(self.layer_idx)
        return self.ops.decode_attention(
            qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            num_q_heads,
            self.scale,
            plan,
            kv_pool.layer_scales(self.layer_idx),
        )


class FusedDecodeBlock(CpuKernel, TransformerBlock):
    """On a planned decode step of up to ``PACKED_LINEAR_MAX_ROWS`` rows: the whole layer in one
    C call (``CpuOps.decode_layer`` over packed weights, ``decode_layer_quant`` over weights as
    stored: ``decode``), the same arithmetic as its modules' C kernels, bit for bit."""

    torch_class = TransformerBlock
    kernel_attrs = ("ops", "weights", "decode")
    weights: DecodeLayerWeights | QuantDecodeLayerWeights
    decode: Callable[..., torch.Tensor]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        plan = meta.cpu_plan
        if plan is None or not _fits(x, PACKED_LINEAR_MAX_ROWS):
            return super().forward(x, cos, sin, kv_pool, meta)
        i = self.attention.attend.layer_idx
        k_cache, v_cache = kv_pool.layer(i)
        tables, lens = meta.block_tables, meta.context_lens
        kv = DecodeLayerKV(k_cache, v_cache, cos, sin, tables, lens, plan, kv_pool.layer_scales(i))
        return self.decode(x, self.weights, kv)
