"""Linear layers over weights kept in their GGUF format, on the GPU path: ``quant_matmul``
computes y = x @ dequantize(w).T (+ bias) for a ``QuantWeight`` (or a ``StackedWeight`` of parts
in several formats) without a float copy of the weight: each program of the Triton kernel loads
the block bytes of a (BLOCK_K values, BLOCK_N rows) tile of the weight, dequantizes them in
registers (the scales read as float16 from the bytes, as ``quant.dequantize`` does) and
multiplies them by a (BLOCK_M, BLOCK_K) tile of x, accumulating in float32. Every format kvmesh
keeps a weight in: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16, in the GGUF layout
(``quant.py``'s docstring has the bytes); the paired layout is the C kernels' (``pair_blocks``,
done by the CPU backend on CPU weights only) and is refused here. float32 activations are
multiplied in full float32 (no TF32: the engine's float path is the reference); bfloat16 and
float16 ones with the tile cast to their dtype, as ``QuantLinear`` casts the dequantized weight,
on the tensor cores (products exact, sums in float32).

Rows of x: any number (one for decode, thousands for prefill; the tile grows from 16 to 64 rows
with them); every edge (rows, output features, a last partial K tile) is masked. A decode call
with fewer output tiles than the GPU has SMs splits K over more programs (``_split_k``), their
float32 partial sums added afterwards. The torch
reference beside it is ``quant_matmul_ref`` (dequantize, then ``F.linear``). ``quant_dequantize``
writes a weight (an embedding's looked-up rows) out in float by the same tile code.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from kvmesh.shared.model.quant import QuantWeight, StackedWeight, dequantize
from kvmesh.shared.model.quant_formats import FORMAT_CODES

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot gives values of 1e10 for
# values of 1): under it a half x's product runs in float32 on the same rounded operands
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SUPPORTED_FORMATS = tuple(FORMAT_CODES)  # every stored format

# format codes (quant_formats.FORMAT_CODES), as the kernel's compile-time constants
_Q8_0 = tl.constexpr(FORMAT_CODES["Q8_0"])
_Q4_0 = tl.constexpr(FORMAT_CODES["Q4_0"])
_Q4_1 = tl.constexpr(FORMAT_CODES["Q4_1"])
_Q5_0 = tl.constexpr(FORMAT_CODES["Q5_0"])
_Q5_1 = tl.constexpr(FORMAT_CODES["Q5_1"])
_Q4_K = tl.constexpr(FORMAT_CODES["Q4_K"])
_Q5_K = tl.constexpr(FORMAT_CODES["Q5_K"])
_Q6_K = tl.constexpr(FORMAT_CODES["Q6_K"])
_F16 = tl.constexpr(FORMAT_CODES["F16"])
_BF16 = tl.constexpr(FORMAT_CODES["BF16"])


@triton.jit
def _byte(u8, offset, mask):
    return tl.load(u8 + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(h, byte_offset, mask):
    """The float16 at an even byte offset, as float32 (0 where masked)."""
    return tl.load(h + byte_offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _nibble(u8, offset, j, mask):
    """Value j (0..31) of a block's 16 nibble bytes at ``offset``: byte j % 16, low nibble for
    j < 16, high for the rest."""
    return (_byte(u8, offset + j % 16, mask) >> ((j // 16) * 4)) & 0x0F


@triton.jit
def _fifth_bit(u8, offset, j, mask):
    """Bit j of the little-endian uint32 qh at ``offset``, as 16 or 0."""
    return ((_byte(u8, offset + j // 8, mask) >> (j % 8)) & 1) << 4


@triton.jit
def _k_scale_min(u8, offset, j, mask):
    """Q4_K's and Q5_K's 6-bit scale and min of sub-block j (0..7) from the 12 bytes s at
    ``offset`` (``quant._k_scales``)."""
    a = _byte(u8, offset + j, mask)  # s[j]
    c = _byte(u8, offset + j + 4, mask)  # s[j + 4]
    e = _byte(u8, offset + tl.where(j >= 4, j - 4, j), mask)  # s[j - 4] (j >= 4)
    sc = tl.where(j < 4, a & 63, (c & 0x0F) | ((e >> 6) << 4))
    mn = tl.where(j < 4, c & 63, (c >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _k_values(u8, h, row, k, mask, BB: tl.constexpr, FIFTH_BIT: tl.constexpr):
    """Q4_K's (``BB`` 144) or Q5_K's (176, ``FIFTH_BIT``: its qh bytes) values k of the rows at
    byte ``row``: d sc[j] q - dmin m[j] in sub-block j."""
    v = k % 256
    j, i = v // 32, v % 32
    base = row + (k // 256) * BB
    qs = base + BB - 128 + 32 * (j // 2) + i  # sub-blocks 2c, 2c + 1 share bytes 32c ..
    q = (_byte(u8, qs, mask) >> (4 * (j % 2))) & 0x0F
    if FIFTH_BIT:
        q = q | (((_byte(u8, base + 16 + i, mask) >> j) & 1) << 4)
    sc, mn = _k_scale_min(u8, base + 4, j, mask)
    scale = _half(h, base, mask) * sc
    return scale * q.to(tl.float32) - _half(h, base + 2, mask) * mn


@triton.jit
def _dequant_tile(u8, i8, h, n, k, rb, mask, FMT: tl.constexpr):
    """Values k (BLOCK_K, 1) of rows n (1, BLOCK_N) of the weight (row ``rb`` bytes), as a
    (BLOCK_K, BLOCK_N) float32 tile; 0 where masked."""
    row = n * rb
    if FMT == _F16 or FMT == _BF16:  # noqa: SIM109 (Triton compiles no `in`)
        w = tl.load(h + row // 2 + k, mask=mask, other=0.0).to(tl.float32)
    elif FMT == _Q8_0:
        base = row + (k // 32) * 34
        w = _half(h, base, mask) * tl.load(i8 + base + 2 + k % 32, mask=mask, other=0).to(
            tl.float32
        )
    elif FMT == _Q4_0:
        base = row + (k // 32) * 18
        q = _nibble(u8, base + 2, k % 32, mask)
        w = _half(h, base, mask) * (q - 8).to(tl.float32)
    elif FMT == _Q4_1:
        base = row + (k // 32) * 20
        q = _nibble(u8, base + 4, k % 32, mask)
        w = _half(h, base, mask) * q.to(tl.float32) + _half(h, base + 2, mask)
    elif FMT == _Q5_0:
        base = row + (k // 32) * 22
        j = k % 32
        q = _nibble(u8, base + 6, j, mask) | _fifth_bit(u8, base + 2, j, mask)
        w = _half(h, base, mask) * (q - 16).to(tl.float32)
    elif FMT == _Q5_1:
        base = row + (k // 32) * 24
        j = k % 32
        q = _nibble(u8, base + 8, j, mask) | _fifth_bit(u8, base + 4, j, mask)
        w = _half(h, base, mask) * q.to(tl.float32) + _half(h, base + 2, mask)
    elif FMT == _Q6_K:
        v = k % 256
        base = row + (k // 256) * 210
        half, s, i = v // 128, (v % 128) // 32, v % 32
        low = (_byte(u8, base + 64 * half + 32 * (s % 2) + i, mask) >> (4 * (s // 2))) & 0x0F
        high = (_byte(u8, base + 128 + 32 * half + i, mask) >> (2 * s)) & 0x03
        sc = tl.load(i8 + base + 192 + v // 16, mask=mask, other=0).to(tl.float32)
        scale = _half(h, base + 208, mask) * sc
        w = scale * ((low | (high << 4)) - 32).to(tl.float32)
    elif FMT == _Q4_K:
        w = _k_values(u8, h, row, k, mask, 144, False)
    else:
        tl.static_assert(FMT == _Q5_K)
        w = _k_values(u8, h, row, k, mask, 176, True)
    return w


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    u8,
    i8,
    h,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    rb,
    stride_xm,
    stride_ym,
    k_split,
    stride_ys,
    FMT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n = rn.to(tl.int64)[None, :]  # byte offsets of big weights pass 2**31
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(2) * k_split  # split-K: values [k_begin, + k_split) of each row
    for k0 in range(k_begin, tl.minimum(K, k_begin + k_split), BLOCK_K):
        k = k0 + rk
        x_mask = (rm[:, None] < M) & (k[None, :] < K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
        w_mask = (k[:, None] < K) & (rn[None, :] < N)
        w = _dequant_tile(u8, i8, h, n, k[:, None], rb, w_mask, FMT)
        if DOT_F32:  # the tile rounded to x's dtype either way
            w = w.to(x.dtype).to(tl.float32)
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
    if bias_ptr is not None:  # None: a compile-time constant
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_mask = (rm[:, None] < M) & (rn[None, :] < N)
    y_ptr += tl.program_id(2) * stride_ys  # a split's partial sums (float32) in its own slice
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), y_mask)


@triton.jit
def _dequantize_kernel(
    u8,
    i8,
    h,
    out_ptr,
    N,
    K,
    rb,
    FMT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (k[:, None] < K) & (rn[None, :] < N)
    n = rn.to(tl.int64)[None, :]
    w = _dequant_tile(u8, i8, h, n, k[:, None], rb, mask, FMT)  # (BLOCK_K, BLOCK_N)
    tl.store(out_ptr + n * K + k[:, None], w.to(out_ptr.dtype.element_ty), mask)


def quant_dequantize(weight: QuantWeight | StackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a (rows, cols) ``dtype`` tensor on its device, dequantized by the same tile
    code as ``quant_matmul`` (the rows an embedding looks up: ``quant.dequantize`` in float32,
    then cast, is its reference)."""
    parts = weight.parts if isinstance(weight, StackedWeight) else (weight,)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
    out = torch.empty(weight.rows, weight.cols, dtype=dtype, device=parts[0].data.device)
    start = 0
    for part in parts:
        _check_layout(part, out.device)
        if part.rows:
            data, block_n, block_k = part.data, 32, 64
            grid = (triton.cdiv(part.rows, block_n), triton.cdiv(part.cols, block_k))
            _dequantize_kernel[grid](
                *_byte_views(part),
                out[start : start + part.rows],
                part.rows,
                part.cols,
                data.shape[1],
                FMT=FORMAT_CODES[part.format],
                BLOCK_N=block_n,
                BLOCK_K=block_k,
            )
        start += part.rows
    return out


def quant_matmul(
    x: torch.Tensor,
    weight: QuantWeight | StackedWeight,
    bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """y = x @ dequantize(weight).T (+ bias): x (..., cols) float32, bfloat16 or float16 on
    the weight's device; returns (..., rows) in x's dtype. A stacked weight: each part's rows by
    its own format into its columns of one output. ``split_k``: how many ranges of K a decode
    call's programs split each row into (``_split_k`` chooses from the device when None)."""
    parts = weight.parts if isinstance(weight, StackedWeight) else (weight,)
    _check_inputs(x, weight, parts, bias)
    x2 = x.reshape(-1, weight.cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], weight.rows, dtype=x.dtype, device=x.device)
    start = 0
    for part in parts:
        end = start + part.rows
        part_bias = None if bias is None else bias[start:end]
        if x2.shape[0]:
            _launch(x2, part, part_bias, out[:, start:end], split_k)
        start = end
    return out.reshape(*x.shape[:-1], weight.rows)


def quant_matmul_ref(
    x: torch.Tensor, weight: QuantWeight | StackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference: the weight dequantized (float32), then ``F.linear`` in float32."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), dequantize(weight), b).to(x.dtype)


def _tiles(rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for ``rows`` rows of x: 16 rows (tl.dot's least) for decode,
    64 for prefill; 64 values of K per step (two blocks of 32, a quarter of a K super-block)."""
    return (16 if rows <= 16 else 64), 64, 64


def _split_k(rows: int, programs: int, k_steps: int, device: torch.device) -> int:
    """Ranges of K per row for a call of ``programs`` (output tiles) on ``device``: a decode
    call (up to 16 rows) of a narrow weight has fewer tiles than the GPU has SMs (SmolLM2's
    q, k, v: 15 on an H100's 132), and one program streaming a whole row range cannot keep the
    memory busy; splitting K gives about two programs per SM, their float32 partial sums added
    afterwards in a fixed order. 1 on the CPU (the interpreter), for prefill and wide weights."""
    if device.type != "cuda" or rows > 16:
        return 1
    sms = _multiprocessors(device.index if device.index is not None else 0)
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), k_steps))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _launch(
    x: torch.Tensor,
    w: QuantWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    split_k: int | None,
) -> None:
    M, K = x.shape
    N = w.rows
    block_m, block_n, block_k = _tiles(M)
    grid_n, grid_m, k_steps = (
        triton.cdiv(N, block_n),
        triton.cdiv(M, block_m),
        triton.cdiv(K, block_k),
    )
    split = split_k or _split_k(M, grid_n * grid_m, k_steps, x.device)
    k_split = triton.cdiv(k_steps, min(split, k_steps)) * block_k  # whole K tiles per range
    split = triton.cdiv(K, k_split)
    y = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _quant_matmul_kernel[(grid_n, grid_m, split)](
        x,
        *_byte_views(w),
        bias if split == 1 else None,
        y,
        M,
        N,
        K,
        w.data.shape[1],
        x.stride(0),
        y.stride(-2),
        k_split,
        y.stride(0) if split > 1 else 0,
        FMT=FORMAT_CODES[w.format],
        DOT_F32=x.dtype == torch.float32 or _INTERPRET,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    if split > 1:
        total = y.sum(0) if bias is None else y.sum(0) + bias.float()
        out.copy_(total)


def _byte_views(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' three views of a weight's bytes: uint8 (nibbles, scales), int8 (Q8_0's and
    Q6_K's signed bytes), 2-byte floats (the scales; an F16 or BF16 weight's values)."""
    half = torch.bfloat16 if w.format == "BF16" else torch.float16
    return w.data, w.data.view(torch.int8), w.data.view(half)


def _check_layout(part: QuantWeight, device: torch.device) -> None:
    if part.paired:
        raise ValueError(
            f"a {part.format} weight in the CPU kernels' paired layout: the Triton kernels read "
            "the GGUF layout (quant.unpair_blocks)"
        )
    if part.data.device != device:
        raise ValueError(f"weight on {part.data.device}, expected {device}")


def _check_inputs(
    x: torch.Tensor,
    weight: QuantWeight | StackedWeight,
    parts: tuple[QuantWeight, ...],
    bias: torch.Tensor | None,
) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != weight.cols:
        raise ValueError(
            f"x must be (..., {weight.cols}) for a {weight.rows} x {weight.cols} weight, got "
            f"shape {tuple(x.shape)}"
        )
    for part in parts:
        _check_layout(part, x.device)
    if bias is not None and (bias.shape != (weight.rows,) or bias.device != x.device):
        raise ValueError(
            f"bias must be ({weight.rows},) on {x.device}, got {tuple(bias.shape)} on {bias.device}"
        )
