"""kernels/cpu_quant.c: linear layers over Q8_0 / Q4_0 / Q4_1 weights as stored, held to the
float definition (dequantize, then matmul) and to a float64 reference that quantizes the
activations exactly as the kernel does (the AVX2 and portable scalar builds: in
test_kernel_cpu_kquant.py, with the other formats)."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kernels.cpu_ops import load_cpu_ops
from kvmesh.kernels.cpu_references import (
    quant_linear_exact_reference,
    quant_linear_reference,
    quantize_activations_reference,
)
from kvmesh.shared.model.quant import FORMAT_CODES, QUANT_FORMATS, quantize

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler for the CPU kernels")


def _case(m: int, k: int, n: int, format: str, seed: int, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0.0  # an all-zero activation block: dx = 0
    w = quantize(torch.randn(n, k, generator=g) * 0.1 + 0.02, format)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _assert_exact(got: torch.Tensor, x, w, b) -> None:
    expected = quant_linear_exact_reference(x, w, b)
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("format", QUANT_FORMATS)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 576, 193), (3, 96, 37), (8, 64, 5), (67, 160, 50)])
def test_quant_linear_matches_the_exact_reference(format: str, m: int, k: int, n: int) -> None:
    x, w, b = _case(m, k, n, format, seed=m * 1000 + k + n, bias=m == 3)
    _assert_exact(ops.quant_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("format", QUANT_FORMATS)
def test_quant_linear_is_close_to_the_dequantized_matmul(format: str) -> None:
    x, w, b = _case(5, 576, 96, format, seed=7, bias=True)
    got, expected = ops.quant_linear(x, w, b), quant_linear_reference(x, w, b)
    # the activations' int8 rounding: about 1/254 of each block's largest value per term
    assert (got - expected).norm() / expected.norm() < 1e-2
    assert not torch.equal(got, expected)  # it does quantize the activations


def test_quant_linear_rows_do_not_depend_on_the_batch_or_threads() -> None:
    x, w, _ = _case(9, 192, 70, "Q4_1", seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([ops.quant_linear(x[i : i + 1], w) for i in range(9)])
        torch.set_num_threads(2)
        together = ops.quant_linear(x, w)
    finally:
        torch.set_num_threads(threads)
    # same integer sums, same float order per (row, column) in every tile shape
    torch.testing.assert_close(together, alone, rtol=1e-6, atol=1e-6)


def test_activation_quantization_rounds_halves_to_even() -> None:
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, -0.5
    q, d = quantize_activations_reference(x)
    assert d.item() == 1.0 and q[0, 0, :3].tolist() == [127.0, 2.0, -0.0]


def test_residual_pass_cuts_the_activation_rounding_error() -> None:
    """The LM head's two passes (x, then what x's int8 rounding left out) come within a small
    fraction of the float product's distance that one int8 pass leaves."""
    from kvmesh.shared.model.cpu_modules import residual_quant_linear
    from kvmesh.shared.model.quant import dequantize

    ops = load_cpu_ops()
    torch.manual_seed(3)
    weight = quantize(torch.randn(512, 256), "Q8_0")
    x = torch.randn(3, 256) * 2
    exact = torch.nn.functional.linear(x, dequantize(weight))
    one_pass = (ops.quant_linear(x, weight) - exact).abs().max()
    two_passes = (residual_quant_linear(ops, x, weight) - exact).abs().max()
    assert two_passes < one_pass / 20, (float(one_pass), float(two_passes))


def test_quant_linear_takes_the_kernel_for_decode_rows_and_float_for_a_prefill_chunk() -> None:
    from kvmesh.shared.model.cpu_modules import FLOAT_GEMM_ROWS, CpuQuantLinear
    from kvmesh.shared.model.quant import dequantize
    from kvmesh.shared.model.quant_layers import QuantLinear

    ops = load_cpu_ops()
    torch.manual_seed(4)
    weight = quantize(torch.randn(96, 128), "Q4_1")
    layer = QuantLinear(weight, None)
    CpuQuantLinear.install(layer, ops)
    decode = torch.randn(FLOAT_GEMM_ROWS - 1, 128)
    chunk = torch.randn(FLOAT_GEMM_ROWS, 128)
    assert torch.equal(layer(decode), ops.quant_linear(decode, weight))
    assert torch.equal(layer(chunk), torch.nn.functional.linear(chunk, dequantize(weight)))
    assert torch.equal(layer(chunk), QuantLinear(weight, None)(chunk))  # torch's, in C


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "k"), [(70, 96), (16, 64), (5, 160), (48, 576)])
def test_dequantize_in_c_gives_torchs_values_bit_for_bit_at_any_threads(format, rows, k) -> None:
    """A prefill chunk's weight (``CpuOps.dequantize``): a paired weight's interleaved groups in
    C, the rows left over (6 of 70; all 5 of 5) and odd block counts (96: 3 blocks) as torch
    dequantizes them; the values of the GGUF layout, bit for bit, whatever the threads."""
    from kvmesh.shared.model.quant import StackedWeight, dequantize
    from kvmesh.shared.model.quant_paired import pair_blocks

    g = torch.Generator().manual_seed(rows + k)
    w = quantize(torch.randn(rows, k, generator=g) * 0.1 - 0.01, format)
    expected = dequantize(w)
    layout = pair_blocks(w) if ops.quant_pairs else w
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(ops.dequantize(layout), expected)
    finally:
        torch.set_num_threads(threads)
    other = quantize(torch.randn(16, k, generator=g), "Q8_0")  # a fused projection's part
    stacked = StackedWeight((layout, pair_blocks(other)))
    assert torch.equal(ops.dequantize(stacked), torch.cat([expected, dequantize(other)]))


def test_residual_pass_reads_the_weight_once_for_both_terms() -> None:
    """x and its rounding error go through the kernel as one batch: the sum is bit for bit that
    of two separate calls (each row's result does not depend on the batch)."""
    from kvmesh.shared.model.cpu_modules import residual_quant_linear

    torch.manual_seed(5)
    weight = quantize(torch.randn(300, 192) * 0.05, "Q8_0")
    x = torch.randn(3, 192)
    qx, dx = quantize_activations_reference(x)
    residual = (x - (qx * dx.unsqueeze(-1)).reshape(x.shape)).contiguous()
    two_calls = ops.quant_linear(x, weight) + ops.quant_linear(residual, weight)
    assert torch.equal(residual_quant_linear(ops, x, weight), two_calls)


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize(("m", "k"), [(1, 576), (3, 96), (8, 160)])
def test_paired_layout_matches_the_exact_reference_at_any_threads(format, m, k) -> None:
    """The VNNI build reads Q4, Q5 and Q8_0 weights repacked (quant.pair_blocks: 16 rows
    interleaved, the 6 left over of 70 in pairs of blocks for Q4): the same integer sums, held to the
    float64 reference; a row's result does not depend on the batch or the threads' split."""
    from kvmesh.shared.model.quant_paired import pair_blocks

    if not ops.quant_pairs:
        pytest.skip("this build reads the GGUF layout only (no AVX-512 VNNI)")
    x, w, b = _case(m, k, 70, format, seed=m + k, bias=True)
    paired = pair_blocks(w)
    assert paired.code == FORMAT_CODES[format] | 16
    got = ops.quant_linear(x, paired, b)
    _assert_exact(got, x, w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert torch.equal(ops.quant_linear(x, paired, b), got)
        assert torch.equal(ops.quant_linear(x[-1:], paired, b), got[-1:])
    finally:
        torch.set_num_threads(threads)
