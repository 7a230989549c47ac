"""kernels/quant_matmul.py: the Triton linear layer over weights kept as stored against its torch
reference (dequantize, then F.linear) and the exact float64 product of the dequantized weight,
for every stored format, at decode and prefill row counts with masked edges; the dequantize
kernel an embedding looks rows up with; and the Triton modules the torch backend installs where
it runs Triton (``triton_modules.py``), which leave the CPU path as it was.

Runs on the CPU under TRITON_INTERPRET=1 (set by `make test`), or on CUDA; kept small (the
interpreter is slow): tests/gpu/test_gpu_quant_matmul.py runs real shapes compiled.
"""

from __future__ import annotations

import pytest
import torch
from kvmesh.shared.model.backend import TorchBackend
from kvmesh.shared.model.quant import (
    K_FORMATS,
    STORED_FORMATS,
    StackedWeight,
    dequantize,
    quantize,
)
from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear, use_quant_weights
from kvmesh.shared.model.quant_paired import pair_blocks
from support.kquant import quantize_k, random_k
from support.triton_device import DEVICE, needs_triton
from torch import nn

pytestmark = needs_triton


def _weight(format: str, rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.1 + 0.01
    q = quantize_k(w, format) if format in K_FORMATS else quantize(w, format)
    return q.to(DEVICE)


def _x(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _exact(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    y = x.double() @ dequantize(w, torch.float64).T
    return y if bias is None else y + bias.double()


def _cols(format: str) -> int:
    return 256 if format in K_FORMATS else 96  # 96: a last K tile of 64 half masked


@pytest.mark.parametrize("format", STORED_FORMATS)
def test_kernel_matches_the_reference_for_every_format(format):
    from kvmesh.kernels.quant_matmul import quant_matmul, quant_matmul_ref

    w = _weight(format, 40, _cols(format), seed=1)  # 40 outputs: a tile of 64 masked
    x = _x(3, w.cols, seed=2)

    y = quant_matmul(x, w)

    assert y.shape == (3, 40) and y.dtype == torch.float32
    torch.testing.assert_close(y, quant_matmul_ref(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.double(), _exact(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("format", K_FORMATS)
def test_k_quants_on_random_blocks_match_the_exact_product(format):
    """Every bit pattern of the 6-bit scales, mins and high bits (a quantizer writes few)."""
    from kvmesh.kernels.quant_matmul import quant_matmul

    w = random_k(format, 33, 512, seed=3).to(DEVICE)
    x = _x(2, 512, seed=4)

    # sums of 512 products of up to ~8: float32's rounding of them
    torch.testing.assert_close(quant_matmul(x, w).double(), _exact(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_decode_and_prefill_row_counts_with_bias_and_leading_dims(rows):
    """One row (decode), an odd few, and 70 (two tiles of 64 rows, the second masked); x with
    a leading batch dimension; the bias added in the kernel."""
    from kvmesh.kernels.quant_matmul import quant_matmul

    w = _weight("Q4_1", 24, 64, seed=5)
    bias = _x(1, 24, seed=6)[0]
    x = _x(rows, 64, seed=7).reshape(1, rows, 64)

    y = quant_matmul(x, w, bias)

    assert y.shape == (1, rows, 24)
    torch.testing.assert_close(y[0].double(), _exact(x[0], w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("format", "cols", "split"), [("Q4_K", 512, 3), ("Q8_0", 96, 2)])
def test_split_k_adds_the_ranges_partial_sums(format, cols, split):
    """A decode call split over K (as on a GPU with more SMs than output tiles): 3 ranges of 3,
    3 and 2 K tiles; 2 ranges, the second a half-masked tile; the bias added once."""
    from kvmesh.kernels.quant_matmul import quant_matmul

    w = _weight(format, 40, cols, seed=20)
    bias = _x(1, 40, seed=21)[0]
    x = _x(2, cols, seed=22)

    y = quant_matmul(x, w, bias, split_k=split)

    torch.testing.assert_close(y.double(), _exact(x, w, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_match_the_reference_within_their_rounding(dtype):
    from kvmesh.kernels.quant_matmul import quant_matmul, quant_matmul_ref

    w = _weight("Q8_0", 40, 128, seed=8)
    x = _x(3, 128, seed=9, dtype=dtype)

    y = quant_matmul(x, w)

    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), quant_matmul_ref(x, w).float(), rtol=2e-2, atol=2e-2)


def test_stacked_weight_multiplies_each_part_in_its_format():
    """A Q4_K_M file's fused q, k, v: Q4_K rows then Q6_K rows, one output, one bias."""
    from kvmesh.kernels.quant_matmul import quant_dequantize, quant_matmul

    w = StackedWeight((_weight("Q4_K", 20, 256, seed=10), _weight("Q6_K", 12, 256, seed=11)))
    bias = _x(1, 32, seed=12)[0]
    x = _x(2, 256, seed=13)

    torch.testing.assert_close(
        quant_matmul(x, w, bias).double(), _exact(x, w, bias), rtol=1e-5, atol=1e-5
    )
    assert torch.equal(quant_dequantize(w, torch.float32), dequantize(w))


@pytest.mark.parametrize("format", ["Q5_1", "Q4_K", "BF16"])
def test_dequantize_kernel_writes_the_weight_as_quant_dequantize_does(format):
    from kvmesh.kernels.quant_matmul import quant_dequantize

    w = _weight(format, 40, _cols(format), seed=14)

    assert torch.equal(quant_dequantize(w, torch.float32), dequantize(w))
    # one bfloat16 step apart at most: the interpreter truncates where CUDA rounds to nearest
    got = quant_dequantize(w, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), dequantize(w), rtol=2**-7, atol=0)


def test_bad_inputs_say_what_to_fix():
    from kvmesh.kernels.quant_matmul import quant_matmul

    w = _weight("Q4_0", 32, 64, seed=15)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\)"):
        quant_matmul(_x(2, 96, seed=16), w)
    with pytest.raises(TypeError, match="x must be one of"):
        quant_matmul(_x(2, 64, seed=16).double(), w)
    with pytest.raises(ValueError, match="bias must be"):
        quant_matmul(_x(2, 64, seed=16), w, torch.zeros(5, device=DEVICE))
    with pytest.raises(ValueError, match="paired layout"):
        quant_matmul(_x(2, 64, seed=16), pair_blocks(w))


class _Toy(nn.Module):
    """A tied embedding (Q8_0) and a linear layer with a bias (Q4_K), kept as stored."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(48, 256)
        self.proj = nn.Linear(256, 40)
        nn.init.normal_(self.proj.bias, generator=torch.Generator().manual_seed(17))
        use_quant_weights(
            self,
            {
                "emb.weight": pair_blocks(_weight("Q8_0", 48, 256, seed=18)),  # a CPU engine's
                "proj.weight": _weight("Q4_K", 40, 256, seed=19),
            },
        )
        self.to(DEVICE)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.emb(ids)
        return self.proj(h), self.emb.project(h)


def test_torch_backend_installs_the_triton_modules_only_where_it_runs_triton():
    from kvmesh.shared.model.triton_modules import TritonQuantEmbedding, TritonQuantLinear

    model, ids = _Toy(), torch.tensor([0, 17, 47, 17, 3], device=DEVICE)
    with torch.no_grad():
        expected = model(ids)  # QuantLinear / QuantEmbedding: dequantize, then torch

        TorchBackend(use_triton=False).install(model)  # the CPU engine's torch path: unchanged
        assert type(model.proj) is QuantLinear and type(model.emb) is QuantEmbedding

        TorchBackend(use_triton=True).install(model)
        assert type(model.proj) is TritonQuantLinear and type(model.emb.head) is TritonQuantLinear
        assert type(model.emb) is TritonQuantEmbedding
        emb = model.emb.qweight  # the GGUF layout again, one copy shared with the head
        assert not emb.paired and model.emb.head.qweight is emb
        got = model(ids)

        TorchBackend(use_triton=False).install(model)  # a later engine undoes them
        assert type(model.proj) is QuantLinear and type(model.emb.head) is QuantLinear
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
