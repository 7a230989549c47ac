"""Weights kept in their GGUF block format: ``QuantWeight``, and the torch definitions of the
formats (dequantize, quantize) that the C kernels (``kernels/cpu_quant.c``) are held to.

A block of 32 consecutive values of one row is stored as:

- ``Q8_0`` (34 bytes): scale d (float16), 32 int8 q; value = d * q
- ``Q4_0`` (18 bytes): d (float16), 16 bytes of nibbles; value = d * (q - 8)
- ``Q4_1`` (20 bytes): d, m (float16), 16 bytes of nibbles; value = d * q + m

where byte j of the nibbles holds value j in its low nibble and value j + 16 in its high one
(llama.cpp's ggml-quants.c). A row of ``cols`` values is ``cols / 32`` blocks back to back, so a
(rows, cols) weight is a (rows, cols / 32 * block bytes) uint8 matrix: rows can be sliced,
permuted and concatenated as bytes.

``pair_blocks`` rewrites a Q4 weight's rows in the layout the VNNI kernels read fastest
(``paired``): each pair of blocks A, B as dA, dB (mA, mB for Q4_1), then 32 bytes, byte j
holding A's value j in its low nibble and B's value j in its high one; a last unpaired block
stays as it was. The same bytes per row and the same values: ``dequantize`` reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvmesh.shared.model.quant_formats import (  # noqa: F401  (re-exported)
    BLOCK,
    BLOCK_BYTES,
    CHECKPOINT_KEY,
    FORMAT_CODES,
    PAIRED_FLAG,
    QUANT_FORMATS,
    row_bytes,
)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A (rows, cols) weight as stored: ``data`` (rows, cols / 32 * block bytes) uint8, in the
    GGUF layout or (``paired``, Q4 only) the kernels' paired one (``pair_blocks``)."""

    format: str
    data: torch.Tensor
    rows: int
    cols: int
    paired: bool = False

    def __post_init__(self) -> None:
        assert self.format in BLOCK_BYTES, f"unknown quantized format {self.format!r}"
        assert self.cols % BLOCK == 0, (self.format, self.cols)
        assert self.data.dtype == torch.uint8 and self.data.is_contiguous(), self.data.dtype
        assert tuple(self.data.shape) == (self.rows, row_bytes(self.format, self.cols)), (
            self.format,
            tuple(self.data.shape),
            self.rows,
            self.cols,
        )
        assert not self.paired or self.format != "Q8_0", "Q8_0 has no paired layout"

    @property
    def code(self) -> int:
        """The kernels' format code (``FORMAT_CODES``, with ``PAIRED_FLAG`` where paired)."""
        return FORMAT_CODES[self.format] | (PAIRED_FLAG if self.paired else 0)

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (1-D int64), as a new QuantWeight."""
        data = self.data.index_select(0, index)
        return QuantWeight(self.format, data, index.numel(), self.cols, self.paired)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.format, self.data.to(device), self.rows, self.cols, self.paired)


def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one format and width stacked along rows (q, k, v into one projection)."""
    first = weights[0]
    assert all(
        (w.format, w.cols, w.paired) == (first.format, first.cols, first.paired) for w in weights
    ), [(w.format, w.cols, w.paired) for w in weights]
    data = torch.cat([w.data for w in weights], dim=0)
    return QuantWeight(first.format, data, data.shape[0], first.cols, first.paired)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32: (..., 1)."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) values 0..15: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _pair_view(weight: QuantWeight) -> tuple[torch.Tensor, int]:
    """The rows' whole pairs of blocks (rows, pairs, 2 * block bytes), and the number of pairs."""
    bb = BLOCK_BYTES[weight.format]
    pairs = weight.cols // BLOCK // 2
    return weight.data[:, : pairs * 2 * bb].view(weight.rows, pairs, 2 * bb), pairs  # a view


def pair_blocks(weight: QuantWeight, in_place: bool = False) -> QuantWeight:
    """A Q4 weight in the paired layout (the module docstring); any other is returned as is.
    ``in_place``: rewrite ``weight.data`` itself (no second copy stays resident; ``weight``
    must not be used afterwards), one row at a time."""
    if weight.paired or weight.format == "Q8_0":
        return weight
    head = 4 if weight.format == "Q4_1" else 2  # scale bytes of a block
    data = weight.data if in_place else weight.data.clone()
    view, _ = _pair_view(QuantWeight(weight.format, data, weight.rows, weight.cols))
    step = 256  # rows at a time: the temporaries stay small
    for r in range(0, weight.rows, step):
        rows = view[r : r + step]
        a, b = rows[..., : rows.shape[-1] // 2], rows[..., rows.shape[-1] // 2 :]
        scales = [a[..., :2], b[..., :2]] + ([a[..., 2:4], b[..., 2:4]] if head == 4 else [])
        values = _nibbles(a[..., head:]) | (_nibbles(b[..., head:]) << 4)
        rows.copy_(torch.cat([*scales, values], -1))
    return QuantWeight(weight.format, data, weight.rows, weight.cols, paired=True)


def unpair_blocks(weight: QuantWeight) -> QuantWeight:
    """A weight in the GGUF layout (the inverse of ``pair_blocks``)."""
    if not weight.paired:
        return weight
    head = 4 if weight.format == "Q4_1" else 2
    view, _ = _pair_view(weight)
    values = view[..., 2 * head :]
    low, high = values & 0x0F, values >> 4  # A's 32 values, B's
    s = view[..., : 2 * head]
    a_scales = [s[..., 0:2]] + ([s[..., 4:6]] if head == 4 else [])
    b_scales = [s[..., 2:4]] + ([s[..., 6:8]] if head == 4 else [])
    blocks = [*a_scales, _pack_nibbles(low), *b_scales, _pack_nibbles(high)]
    data = weight.data.clone()
    data[:, : view.shape[1] * view.shape[2]] = torch.cat(blocks, -1).flatten(1)
    return QuantWeight(weight.format, data, weight.rows, weight.cols)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The weight as a float32 (rows, cols) tensor, as ggml dequantizes it."""
    weight = unpair_blocks(weight)
    blocks = weight.data.view(weight.rows, weight.cols // BLOCK, BLOCK_BYTES[weight.format])
    d = _f16(blocks, 0)
    if weight.format == "Q8_0":
        values = d * blocks[..., 2:].contiguous().view(torch.int8).float()
    elif weight.format == "Q4_0":
        values = d * (_nibbles(blocks[..., 2:]).float() - 8)
    else:  # Q4_1
        values = d * _nibbles(blocks[..., 4:]).float() + _f16(blocks, 2)
    return values.reshape(weight.rows, weight.cols)


def block_terms(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) with value = d * q + m per block: q (rows, blocks, 32) the stored integers as
    float32 (int8 for Q8_0, nibbles 0..15 for Q4), d and m (rows, blocks) (Q8_0: m = 0; Q4_0:
    m = -8 d). The C kernels multiply q by the activations' integers and add the d, m terms."""
    weight = unpair_blocks(weight)
    blocks = weight.data.view(weight.rows, weight.cols // BLOCK, BLOCK_BYTES[weight.format])
    d = _f16(blocks, 0)
    if weight.format == "Q8_0":
        q, m = blocks[..., 2:].contiguous().view(torch.int8).float(), torch.zeros_like(d)
    elif weight.format == "Q4_0":
        q, m = _nibbles(blocks[..., 2:]).float(), -8 * d
    else:
        q, m = _nibbles(blocks[..., 4:]).float(), _f16(blocks, 2)
    return q, d.squeeze(-1), m.squeeze(-1)


def quantize(weight: torch.Tensor, format: str) -> QuantWeight:
    """A float (rows, cols) weight in ``format``, bit for bit as gguf's (and ggml's reference)
    quantizers write it: scales computed in float32, stored as float16."""
    assert format in BLOCK_BYTES, f"unknown quantized format {format!r}"
    rows, cols = weight.shape
    assert cols % BLOCK == 0, (rows, cols)
    x = weight.detach().float().reshape(rows, cols // BLOCK, BLOCK)
    if format == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, 0.0, 1 / d)
        v = x * inv
        q = (v.abs() + 0.5).floor().copysign(v)  # roundf: halves away from zero
        parts = [_as_f16_bytes(d), q.to(torch.int8).view(torch.uint8)]
    elif format == "Q4_0":
        imax = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, imax) / -8
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = (x * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        parts = [_as_f16_bytes(d), _pack_nibbles(q)]
    else:  # Q4_1
        hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = ((x - lo) * inv + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        parts = [_as_f16_bytes(d), _as_f16_bytes(lo), _pack_nibbles(q)]
    data = torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()
    return QuantWeight(format, data, rows, cols)


def _as_f16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return q[..., :16] | (q[..., 16:] << 4)
