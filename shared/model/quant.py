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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvmesh.shared.model.quant_formats import (  # noqa: F401  (re-exported)
    BLOCK,
    BLOCK_BYTES,
    CHECKPOINT_KEY,
    FORMAT_CODES,
    QUANT_FORMATS,
    row_bytes,
)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A (rows, cols) weight as stored: ``data`` (rows, cols / 32 * block bytes) uint8."""

    format: str
    data: torch.Tensor
    rows: int
    cols: int

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

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def select_rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (1-D int64), as a new QuantWeight."""
        return QuantWeight(self.format, self.data.index_select(0, index), index.numel(), self.cols)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.format, self.data.to(device), self.rows, self.cols)


def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Weights of one format and width stacked along rows (q, k, v into one projection)."""
    first = weights[0]
    assert all(w.format == first.format and w.cols == first.cols for w in weights), [
        (w.format, w.cols) for w in weights
    ]
    data = torch.cat([w.data for w in weights], dim=0)
    return QuantWeight(first.format, data, data.shape[0], first.cols)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32: (..., 1)."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) values 0..15: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(weight: QuantWeight) -> torch.Tensor:
    """The weight as a float32 (rows, cols) tensor, as ggml dequantizes it."""
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
