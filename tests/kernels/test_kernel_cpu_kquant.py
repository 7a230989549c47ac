"""kernels/cpu_kquant.c: linear layers over K-quant (Q4_K, Q5_K, Q6_K) and F16/BF16 weights as
stored, and stacked weights whose row ranges come in different formats (a Q4_K_M file's q, k
and v): the torch definitions (``quant.dequantize``) against gguf's, the kernels against a float64
reference that quantizes the activations as they do and against the dequantized float32 matmul,
the portable scalar build, and the fused decode layer over these formats against the module path."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from kvmesh.kernels.cpu_ops import QuantDecodeLayerWeights, load_cpu_ops
from kvmesh.kernels.cpu_references import quant_linear_exact_reference, quant_linear_reference
from kvmesh.shared.model.cpu_modules import CpuQuantEmbedding, CpuQuantLinear
from kvmesh.shared.model.quant import (
    FLOAT_FORMATS,
    K_FORMATS,
    STORED_FORMATS,
    StackedWeight,
    cat_rows,
    dequantize,
    quantize,
)
from kvmesh.shared.model.quant_layers import QuantEmbedding
from kvmesh.shared.model.quant_paired import pair_blocks
from support.cpu_layers import LINEARS, decode_step, layer_config, quantized_twins, run_step_ways
from support.kquant import quantize_k, random_k
from support.quant_builds import build_quant_lib, cpu_has, qlinear

ops = load_cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="no C compiler for the CPU kernels")
NEW_FORMATS = K_FORMATS + FLOAT_FORMATS


def _weight(format: str, rows: int, cols: int, seed: int, scale: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * scale + 0.01
    return quantize_k(w, format) if format in K_FORMATS else quantize(w, format)


def _x(rows: int, cols: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero activation block: dx = 0
    return x


def _assert_exact(got, x, w, b=None) -> None:
    expected = quant_linear_exact_reference(x, w, b)
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("format", NEW_FORMATS)
def test_dequantize_matches_gguf_bit_for_bit(format: str) -> None:
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    if format in K_FORMATS:  # every bit pattern of scales and values
        w = random_k(format, 5, 512, seed=1)
    else:
        w = _weight(format, 5, 512, seed=1)
    expected = gguf_quants.dequantize(w.data.numpy(), GGMLQuantizationType[format])
    got = dequantize(w)
    assert torch.equal(got, torch.from_numpy(np.asarray(expected, np.float32)).reshape(5, 512))
    torch.testing.assert_close(dequantize(w, torch.float64).float(), got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("format", K_FORMATS)
def test_test_quantizer_is_the_dequantizers_inverse(format: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(7, 512, generator=g) * 0.1
    back = dequantize(quantize_k(w, format))
    # rounding to 16, 32 or 64 levels per sub-block (a layout mismatch would be ~1.4)
    bound = {"Q4_K": 0.2, "Q5_K": 0.1, "Q6_K": 0.05}[format]
    assert (back - w).norm() / w.norm() < bound


@pytest.mark.parametrize("format", NEW_FORMATS)
@pytest.mark.parametrize(
    ("m", "k", "n", "bias"), [(1, 512, 37, False), (4, 256, 19, True), (67, 256, 9, False)]
)
def test_kernel_matches_the_exact_reference(format, m, k, n, bias) -> None:
    w = _weight(format, n, k, seed=m + n)
    x = _x(m, k, seed=m * k)
    b = torch.randn(n) if bias else None
    _assert_exact(ops.quant_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("format", K_FORMATS)
def test_kernel_on_random_blocks_matches_the_exact_reference(format) -> None:
    w = random_k(format, 23, 512, seed=4)
    x = _x(3, 512, seed=5)
    _assert_exact(ops.quant_linear(x, w), x, w)


@pytest.mark.parametrize("format", NEW_FORMATS)
def test_kernel_is_close_to_the_dequantized_matmul(format) -> None:
    w = _weight(format, 96, 512, seed=6)
    x, b = _x(5, 512, seed=7), torch.randn(96)
    got, expected = ops.quant_linear(x, w, b), quant_linear_reference(x, w, b)
    error = ((got - expected).norm() / expected.norm()).item()
    if format in FLOAT_FORMATS:  # x read as float32: only the order of the sums differs
        assert error < 1e-6
    else:  # the activations' int8 rounding
        assert 0 < error < 1e-2


def _stacked(cols: int = 256) -> StackedWeight:
    parts = [
        _weight("Q4_K", 37, cols, 1),
        _weight("Q6_K", 20, cols, 2),
        _weight("Q4_1", 27, cols, 3),  # a group of 16 rows and 11 left over
        _weight("BF16", 6, cols, 4),
    ]
    stacked = cat_rows(parts)
    assert isinstance(stacked, StackedWeight) and stacked.shape == (90, cols)
    return pair_blocks(stacked) if ops.quant_pairs else stacked  # its Q4 part paired


@pytest.mark.parametrize("threads", [1, 3])
def test_stacked_weight_computes_each_part_in_its_format(threads) -> None:
    w = _stacked()
    x, b = _x(3, 256, seed=8), torch.randn(90)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # 3 threads: shares cut inside parts
    try:
        got = ops.quant_linear(x, w, b)
        alone = torch.cat([ops.quant_linear(x, p) for p in w.parts], -1) + b
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, alone)  # each column by its part's kernel, whatever the tile
    _assert_exact(got, x, w, b)
    assert torch.equal(dequantize(w), torch.cat([dequantize(p) for p in w.parts]))
    picked = w.select_rows(torch.tensor([40, 41, 0, 73]))
    assert torch.equal(dequantize(picked), dequantize(w)[[40, 41, 0, 73]])


def test_float_tied_head_reads_the_activations_once() -> None:
    """An F16 embedding as the LM head: x read as float32, no residual int8 pass (which would
    count x twice)."""
    weight = _weight("F16", 300, 256, seed=9)
    embedding = QuantEmbedding(weight, torch.float32)
    CpuQuantEmbedding.install(embedding, ops)
    CpuQuantLinear.install(embedding.head, ops)
    x = _x(2, 256, seed=10)
    torch.testing.assert_close(embedding.project(x), quant_linear_reference(x, weight))


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_avx2_and_portable_builds_match_the_exact_reference(tmp_path, march) -> None:
    """cpu_quant.c and cpu_kquant.c built for a CPU without AVX-512 VNNI: AVX2 with FMA and F16C
    (haswell), and the scalar loops (plain x86-64), on every format and a stacked weight."""
    if march == "haswell" and not cpu_has("avx2", "fma", "f16c"):
        pytest.skip("this CPU cannot run an AVX2 build")
    lib = build_quant_lib(tmp_path, march)
    x, b = _x(5, 512, seed=11), torch.randn(21)
    for format in STORED_FORMATS:
        w = _weight(format, 21, 512, seed=12)
        _assert_exact(qlinear(lib, x, w, b), x, w, b)
    stacked = cat_rows([_weight(f, 9, 512, seed=13) for f in ("Q4_K", "Q6_K", "Q8_0", "F16")])
    _assert_exact(qlinear(lib, x, stacked, None), x, stacked)


def _stored_layers(config, formats):
    """The model twice: its linear weights as stored, each in its own format (wqkv: q, k and v
    parts, stacked where they differ), and as the float32 values those hold."""
    format_of = dict(zip(LINEARS, formats, strict=True))
    n_q = config.num_attention_heads * config.head_dim
    n_kv = config.num_key_value_heads * config.head_dim

    def q(t, fmt):
        return quantize_k(t, fmt) if fmt in K_FORMATS else quantize(t, fmt)

    def stored_weight(name, weight):
        w, format = weight * 0.3, format_of[name]
        if isinstance(format, tuple):  # q, k, v
            parts = w.split([n_q, n_kv, n_kv])
            return cat_rows([q(t, f) for t, f in zip(parts, format, strict=True)])
        return q(w, format)

    return quantized_twins(config, stored_weight)


@pytest.mark.parametrize(
    ("formats", "context_lens"),
    [
        ((("Q4_K", "Q4_K", "Q6_K"), "Q4_K", "Q4_K", "Q6_K"), [7]),  # a Q4_K_M layer, batch 1
        ((("Q5_K", "BF16", "Q8_0"), "F16", "Q5_K", "BF16"), [16, 3, 40]),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_decode_layer_takes_k_quants_floats_and_stacked_weights(
    formats, context_lens, threads
):
    config = layer_config(256, 256, 4, 2, 64, False)
    stored, floats = _stored_layers(config, formats)
    runs = run_step_ways(stored, ops, decode_step(config, context_lens), threads, floats)
    assert all(isinstance(w, QuantDecodeLayerWeights) for w in runs.fused_weights)
    assert torch.equal(runs.fused, runs.unfused)  # the same kernels in the same order
    assert torch.equal(runs.fused_pool.tensor, runs.unfused_pool.tensor)
    assert (runs.fused - runs.reference).norm() / runs.reference.norm() < 5e-2  # int8 activations
