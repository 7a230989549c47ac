"""Linear layers and embeddings over weights kept in their GGUF format (``QuantWeight``, or a
``StackedWeight`` of parts in several).

``use_quant_weights(model, weights)`` swaps a built model's ``Linear`` and ``Embedding`` modules
for these, by parameter name, from outside the model (the loader calls it on the meta-device
model before the float weights are filled in). Their ``forward`` dequantizes the weight for the
call and multiplies in torch; the CPU backend installs its kernel subclasses over them
(``cpu_modules.CpuQuantLinear``, ``CpuQuantEmbedding``), which read the weight as stored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from kvmesh.shared.model.quant import QuantWeight, StackedWeight, dequantize
from torch import nn


class QuantLinear(nn.Module):
    """y = x @ w.T (+ bias) with w a ``QuantWeight`` or ``StackedWeight`` (out_features,
    in_features)."""

    def __init__(self, weight: QuantWeight | StackedWeight, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.cols, weight.rows
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        """Logits (rows, vocab): hidden @ w.T."""
        return self.head(hidden)

    def extra_repr(self) -> str:
        return f"{self.qweight.rows}, {self.qweight.cols}, {self.qweight.format}"


def keeps_weights_stored(model: nn.Module) -> bool:
    """Whether any of ``model``'s weights is kept as stored (a ``QuantLinear`` or
    ``QuantEmbedding``, or a backend's subclass of one): what "auto" KV reads
    (``EngineConfig.kv_dtype``)."""
    return any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in model.modules())


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
