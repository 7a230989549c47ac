"""Linear layers and embeddings over weights kept in their block format (``QuantWeight``).

``use_quant_weights(model, weights)`` swaps a built model's ``Linear`` and ``Embedding`` modules
for these, by parameter name, from outside the model (the loader calls it on the meta-device
model before the float weights are filled in). With a ``CpuOps`` attached
(``llama.attach_cpu_ops``) a float32 CPU input runs ``CpuOps.quant_linear`` (the weight read as
stored, the activations quantized per block of 32 to int8); otherwise the weight is dequantized
for the call and multiplied in torch: the same function, slowly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from kvmesh.shared.model.quant import QuantWeight, dequantize
from torch import nn

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_ops import CpuOps


class QuantLinear(nn.Module):
    """y = x @ w.T (+ bias) with w a ``QuantWeight`` (out_features, in_features)."""

    def __init__(self, weight: QuantWeight, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = bias
        self.cpu_ops: CpuOps | None = None  # set by attach_cpu_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and _is_kernel_input(x):
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
        return self.head(hidden)

    def extra_repr(self) -> str:
        return f"{self.qweight.rows}, {self.qweight.cols}, {self.qweight.format}"


def _is_kernel_input(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 2 and x.is_cpu and x.is_contiguous()


def use_quant_weights(model: nn.Module, weights: Mapping[str, QuantWeight]) -> None:
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
