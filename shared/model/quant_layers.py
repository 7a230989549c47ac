"""Linear layers and embeddings over weights kept in their GGUF format (``QuantWeight``, or a
``StackedWeight`` of parts in several).

``use_quant_weights(model, weights)`` swaps a built model's ``Linear`` and ``Embedding`` modules
for these, by parameter name, from outside the model (the loader calls it on the meta-device
model before the float weights are filled in). With a ``CpuOps`` attached
(``llama.attach_cpu_ops``) a float32 CPU input runs ``CpuOps.quant_linear`` (the weight read as
stored, the activations quantized per block of 32 to int8 for a block format, float32 for F16
and BF16); otherwise the weight is dequantized for the call and multiplied in torch: the same
function, slowly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from kvmesh.shared.model.quant import FLOAT_FORMATS, QuantWeight, StackedWeight, dequantize
from torch import nn

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_ops import CpuOps


# From this many rows on (a prefill chunk) the weight is dequantized and multiplied in float: the
# dequantization is paid once for all the rows, the GEMM runs at float speed, and the prompt's
# activations keep their precision. Decode's few rows take the kernel (int8 activations), where
# reading the weight as stored is the whole cost. SmolLM2's greedy answer to the README's
# question turns on small margins that int8 activations in the prompt's layers flip (issue 41).
FLOAT_GEMM_ROWS = 16


class QuantLinear(nn.Module):
    """y = x @ w.T (+ bias) with w a ``QuantWeight`` or ``StackedWeight`` (out_features,
    in_features)."""

    def __init__(self, weight: QuantWeight | StackedWeight, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = bias
        self.cpu_ops: CpuOps | None = None  # set by attach_cpu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and _is_kernel_input(x) and x.shape[0] < FLOAT_GEMM_ROWS:
            return self.cpu_ops.quant_linear(x, self.qweight, self.bias)
        return F.linear(x, dequantize(self.qweight).to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"{w.cols} -> {w.rows}, {w.format}, bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """Token embeddings as a ``QuantWeight`` (vocab, hidden): rows dequantized on lookup;
    ``project`` multiplies by it (a tied LM head: hidden -> vocab logits)."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype
        self.head = QuantLinear(weight, None)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.select_rows(input_ids.reshape(-1).to(self.qweight.data.device))
        return dequantize(rows).to(self.dtype).reshape(*input_ids.shape, -1)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (rows, vocab). On the kernels, with the activations quantized twice (the
        hidden state, then what that left out): the logits' margins are what greedy decoding
        turns on, and one int8 pass flips small ones (issue 41). An F16 or BF16 head reads
        the activations as float32: one pass."""
        head = self.head
        is_float = self.qweight.format in FLOAT_FORMATS
        if head.cpu_ops is None or not _is_kernel_input(hidden) or is_float:
            return head(hidden)
        return residual_quant_linear(head.cpu_ops, hidden, self.qweight)

    def extra_repr(self) -> str:
        return f"{self.qweight.rows}, {self.qweight.cols}, {self.qweight.format}"


def residual_quant_linear(
    ops: CpuOps, x: torch.Tensor, weight: QuantWeight | StackedWeight
) -> torch.Tensor:
    """x @ w.T with x's int8 rounding error itself multiplied in: y = W q(x) + W q(x - q(x)),
    where q is the kernels' per-block int8 quantization. The two terms are about 16-bit
    activations, the weight still read as stored. x and its residual go through the kernel as
    one batch of twice the rows, so the weight is read once (each row's result does not depend
    on the others). x: (rows, in) float32 contiguous."""
    from kvmesh.kernels.cpu_bindings import quantize_activations_reference

    qx, dx = quantize_activations_reference(x)
    residual = x - (qx * dx.unsqueeze(-1)).reshape(x.shape)
    both = ops.quant_linear(torch.cat([x, residual]), weight)
    rows = x.shape[0]
    return both[:rows] + both[rows:]


def _is_kernel_input(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and x.is_contiguous()


def use_quant_weights(model: nn.Module, weights: Mapping[str, QuantWeight | StackedWeight]) -> None:
    """Replace the module owning each parameter named in ``weights`` (``layers.0.attention.wqkv.
    weight``, ``tok_embeddings.weight`` ...) by its quantized twin; a linear layer keeps its bias
    parameter."""
    for name, weight in weights.items():
        path, leaf = name.rsplit(".", 1)
        assert leaf == "weight", name
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if isinstance(old, nn.Embedding):
            assert (old.num_embeddings, old.embedding_dim) == weight.shape, (name, weight.shape)
            new: nn.Module = QuantEmbedding(weight, old.weight.dtype)
        else:
            assert isinstance(old, nn.Linear), (name, type(old))
            assert (old.out_features, old.in_features) == weight.shape, (name, weight.shape)
            new = QuantLinear(weight, old.bias)
        setattr(parent, attr, new)
