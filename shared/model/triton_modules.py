"""The Triton kernels as subclasses of the model's modules, installed by ``TorchBackend`` when it
runs Triton (``use_triton``: an engine on CUDA), as ``CpuBackend`` installs the C kernels
(``cpu_modules.py``): a module's class is set, so parameters and references stay as they are,
and ``remove_triton_kernels`` sets it back.

``TritonQuantLinear`` multiplies by a weight kept as stored with ``kernels/quant_matmul.py``
(dequantized in the kernel's tiles) instead of ``QuantLinear``'s dequantize-then-matmul, for
every row count (decode and prefill); a tied LM head is its embedding's ``head`` (a
``QuantLinear``), so the logits take it too. ``TritonQuantEmbedding`` dequantizes the rows it
looks up with the same tile code. A model's weights are the same on either path: the
format choice does not fork the engine.
"""

from __future__ import annotations

import os

import torch
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear
from kvmesh.shared.model.quant_paired import unpair_blocks
from torch import nn

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # quant_matmul.SUPPORTED_DTYPES


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on tensors of ``device``: CUDA, or the CPU under the
    interpreter (``TRITON_INTERPRET=1``, the tests)."""
    return device.type == "cuda" or (
        device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    )


class TritonQuantLinear(QuantLinear):
    """``QuantLinear`` through ``quant_matmul``; other inputs (an integer dtype, another
    device) take ``QuantLinear``'s torch math."""

    torch_class = QuantLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in _DTYPES and x.device == self.qweight.data.device:
            from kvmesh.kernels.quant_matmul import quant_matmul

            return quant_matmul(x, self.qweight, self.bias)
        return super().forward(x)


class TritonQuantEmbedding(QuantEmbedding):
    """``QuantEmbedding`` whose looked-up rows are dequantized by ``quant_dequantize`` (the
    torch dequantization's shifts are CPU tensors: the K-quants and Q5 would not run on CUDA);
    its tied head (``head``) is a ``TritonQuantLinear``."""

    torch_class = QuantEmbedding

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        from kvmesh.kernels.quant_matmul import quant_dequantize

        rows = self.qweight.select_rows(input_ids.reshape(-1).to(self.qweight.data.device))
        return quant_dequantize(rows, self.dtype).reshape(*input_ids.shape, -1)


_TRITON = {QuantLinear: TritonQuantLinear, QuantEmbedding: TritonQuantEmbedding}


def install_triton_kernels(model: nn.Module) -> int:
    """Set every ``QuantLinear`` and ``QuantEmbedding`` whose weight is where Triton runs to its
    Triton subclass (a weight in the C kernels' paired layout put back in the GGUF layout first;
    an embedding and its tied head keep sharing one copy); returns how many."""
    count = 0
    for module in list(model.modules()):
        kind = type(module)
        if kind not in _TRITON or not triton_runs_on(module.qweight.data.device):
            continue
        module.qweight = unpair_blocks(module.qweight)
        if kind is QuantEmbedding:
            module.head.qweight = module.qweight
        module.__class__ = _TRITON[kind]
        count += 1
    return count


def remove_triton_kernels(model: nn.Module) -> None:
    """Every module ``install_triton_kernels`` set back to its torch class."""
    for module in model.modules():
        if isinstance(module, (TritonQuantLinear, TritonQuantEmbedding)):
            module.__class__ = module.torch_class
