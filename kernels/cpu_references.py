"""The torch definitions the CPU kernels (``cpu_bindings.CpuOps``) are held to in the tests,
and the activations' int8 quantization as the kernels do it (``residual_quant_linear`` uses it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvmesh.shared.model.quant import FLOAT_FORMATS, QuantWeight, StackedWeight, dequantize


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * x.square().mean(-1, keepdim=True).add(eps).rsqrt() * weight


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (rows, k) as the kernels quantize it: per block of 32, dx = max|x| / 127 and q =
    x / dx rounded half to even. Returns q (rows, k / 32, 32) float32 integers, dx (rows, k / 32)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d == 0, 0.0, 1 / d)
    return torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127), d


def quant_linear_reference(
    x: torch.Tensor, weight: QuantWeight | StackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The float definition: x @ dequantize(w).T (+ bias)."""
    return F.linear(x, dequantize(weight), bias)


def quant_linear_exact_reference(
    x: torch.Tensor, weight: QuantWeight | StackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What ``CpuOps.quant_linear`` computes, in float64: x quantized per block
    (``quantize_activations_reference``; for an F16 or BF16 weight x as it is) times the
    weight's exact values (``dequantize`` in float64), so per block dw dx sum(qw qx) + mw dx
    sum(qx) with exact integer sums. A stacked weight: each part's columns by its own format."""
    qx, dx = quantize_activations_reference(x)
    quantized = (qx.double() * dx.double().unsqueeze(-1)).reshape(x.shape)
    parts = weight.parts if isinstance(weight, StackedWeight) else (weight,)
    ys = [
        (x.double() if p.format in FLOAT_FORMATS else quantized) @ dequantize(p, torch.float64).T
        for p in parts
    ]
    y = torch.cat(ys, -1).float()
    return y if bias is None else y + bias
