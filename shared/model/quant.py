"""Weights kept in their GGUF format: ``QuantWeight``, ``StackedWeight``, and the torch
definitions of the formats (dequantize, quantize) that the C kernels (``kernels/cpu_quant.c``,
``kernels/cpu_kquant.c``) are held to.

A block of 32 consecutive values of one row is stored as:

- ``Q8_0`` (34 bytes): scale d (float16), 32 int8 q; value = d * q
- ``Q4_0`` (18 bytes): d (float16), 16 bytes of nibbles; value = d * (q - 8)
- ``Q4_1`` (20 bytes): d, m (float16), 16 bytes of nibbles; value = d * q + m
- ``Q5_0`` (22 bytes): d, 4 bytes qh, 16 bytes of nibbles; value = d * (q - 16)
- ``Q5_1`` (24 bytes): d, m, 4 bytes qh, 16 bytes of nibbles; value = d * q + m

where byte j of the nibbles holds value j in its low nibble and value j + 16 in its high one,
and bit j of qh (a little-endian uint32) is value j's fifth bit (16) (llama.cpp's ggml-quants.c). The K-quants pack 256 values (8 sub-blocks of 32, or 16 of 16):

- ``Q4_K`` (144 bytes): d, dmin (float16), 12 bytes of 6-bit scales sc[8] and mins m[8]
  (``_k_scales``), 128 bytes of nibbles: bytes 32c .. 32c + 32 hold sub-block 2c in their low
  nibbles and 2c + 1 in their high ones; value = d sc[j] q - dmin m[j] in sub-block j
- ``Q5_K`` (176 bytes): as Q4_K with 32 bytes qh between the scales and the nibbles: bit j of
  qh[i] is the fifth bit (16) of value i of sub-block j
- ``Q6_K`` (210 bytes): ql[128] low nibbles, qh[64] two high bits each, scales[16] int8, d
  (float16) last; value = d scales[v / 16] (q - 32), q of value v = 128h + 32s + i (half h,
  i < 32): nibble s / 2 (low, high) of ql[64h + 32 (s % 2) + i], bits 2s, 2s + 1 of qh[32h + i]

and ``F16``, ``BF16`` are plain 2-byte floats. A row of ``cols`` values is its blocks back to
back, so a (rows, cols) weight is a (rows, row bytes) uint8 matrix: rows can be sliced, permuted
and concatenated as bytes. A weight whose row ranges come in different formats (a Q4_K_M file's
q, k in Q4_K and v in Q6_K, fused into one projection) is a ``StackedWeight`` of parts.

``pair_blocks`` (quant_paired.py) rewrites a Q4, Q5 or Q8_0 weight's rows in the layout the VNNI
kernels read fastest (``paired``); ``dequantize`` reads both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvmesh.shared.model.quant_formats import (  # noqa: F401  (re-exported)
    BLOCK,
    BLOCK_BYTES,
    BLOCK_VALUES,
    CHECKPOINT_KEY,
    FLOAT_FORMATS,
    FORMAT_CODES,
    K_FORMATS,
    MAX_STACKED_PARTS,
    PAIRED_FLAG,
    QUANT_FORMATS,
    STACKED_CODE,
    STORED_FORMATS,
    cols_multiple,
    row_bytes,
)

PAIRABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # the formats pair_blocks rewrites
GROUP = 16  # rows interleaved together in the paired layout (cpu_quant.c's QG)


@dataclass(frozen=True, slots=True)
class QuantWeight:
    """A (rows, cols) weight as stored: ``data`` (rows, row bytes) uint8, in the GGUF layout or
    (``paired``, Q4_0 and Q4_1 only) the kernels' paired one (``pair_blocks``)."""

    format: str
    data: torch.Tensor
    rows: int
    cols: int
    paired: bool = False

    def __post_init__(self) -> None:
        assert self.format in BLOCK_BYTES, f"unknown quantized format {self.format!r}"
        assert self.cols % cols_multiple(self.format) == 0, (self.format, self.cols)
        assert self.data.dtype == torch.uint8 and self.data.is_contiguous(), self.data.dtype
        assert tuple(self.data.shape) == (self.rows, row_bytes(self.format, self.cols)), (
            self.format,
            tuple(self.data.shape),
            self.rows,
            self.cols,
        )
        assert not self.paired or self.format in PAIRABLE, f"{self.format} has no paired layout"

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
        """The rows ``index`` (1-D int64), as a new QuantWeight (in the GGUF layout)."""
        index = index.to(self.data.device)  # TP's row ranges come on the CPU
        if self.paired:
            from kvmesh.shared.model.quant_paired import paired_rows

            return QuantWeight(self.format, paired_rows(self, index), index.numel(), self.cols)
        data = self.data.index_select(0, index)
        return QuantWeight(self.format, data, index.numel(), self.cols)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.format, self.data.to(device), self.rows, self.cols, self.paired)


def cat_rows(weights: list[QuantWeight]) -> QuantWeight | StackedWeight:
    """Weights of one width stacked along rows (q, k, v into one projection): one QuantWeight
    where they share a format, else a ``StackedWeight`` of copies of them (in the GGUF layout)."""
    from kvmesh.shared.model.quant_paired import unpair_blocks

    weights = [unpair_blocks(w) for w in weights]
    first = weights[0]
    assert all(w.cols == first.cols for w in weights), [w.shape for w in weights]
    if any((w.format, w.paired) != (first.format, first.paired) for w in weights):
        return StackedWeight(
            tuple(QuantWeight(w.format, w.data.clone(), *w.shape, w.paired) for w in weights)
        )
    data = torch.cat([w.data for w in weights], dim=0)
    return QuantWeight(first.format, data, data.shape[0], first.cols, first.paired)


@dataclass(frozen=True, slots=True)
class StackedWeight:
    """A (rows, cols) weight whose rows are ``parts`` (QuantWeights of one width, each in its own
    format) one after another. ``data`` is what the kernels read for it (``STACKED_CODE``): the
    ``kv_wstack`` descriptor of kernels/cpu_quant.c, int64 count, then each part's format code,
    row count and data address (``MAX_STACKED_PARTS`` slots each); the parts must stay alive and
    in place while it is used (they are, held here)."""

    parts: tuple[QuantWeight, ...]
    data: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        parts = self.parts
        assert 1 < len(parts) <= MAX_STACKED_PARTS, len(parts)
        assert all(p.cols == parts[0].cols for p in parts), [p.shape for p in parts]
        slots = MAX_STACKED_PARTS
        desc = [0] * (1 + 3 * slots)
        desc[0] = len(parts)
        for i, p in enumerate(parts):
            desc[1 + i] = p.code
            desc[1 + slots + i] = p.rows
            desc[1 + 2 * slots + i] = p.data.data_ptr() if p.data.is_cpu else 0
        object.__setattr__(self, "data", torch.tensor(desc, dtype=torch.int64))

    @property
    def format(self) -> str:
        return "+".join(p.format for p in self.parts)

    @property
    def code(self) -> int:
        return STACKED_CODE

    @property
    def paired(self) -> bool:
        return False

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def select_rows(self, index: torch.Tensor) -> QuantWeight | StackedWeight:
        """The rows ``index`` (1-D int64), taken from each part in runs: a QuantWeight where
        they all come from one part."""
        bounds = torch.tensor([0] + [p.rows for p in self.parts]).cumsum(0)
        owner = torch.bucketize(index, bounds[1:], right=True)
        runs: list[QuantWeight] = []
        start = 0
        for end in [*(torch.nonzero(owner[1:] != owner[:-1]).flatten() + 1).tolist(), len(index)]:
            i = int(owner[start])
            runs.append(self.parts[i].select_rows(index[start:end] - int(bounds[i])))
            start = end
        if len(runs) == 1:
            return runs[0]
        if len(runs) > MAX_STACKED_PARTS:
            raise ValueError(
                f"rows of a weight stored in formats {self.format} taken in {len(runs)} runs; "
                f"at most {MAX_STACKED_PARTS} (load the model with --dequantize)"
            )
        return StackedWeight(tuple(runs))

    def to(self, device: torch.device | str) -> StackedWeight:
        return StackedWeight(tuple(p.to(device) for p in self.parts))


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block, as float32: (..., 1)."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32) values 0..15: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize(
    weight: QuantWeight | StackedWeight,
    dtype: torch.dtype = torch.float32,
    groups: Callable[[str, torch.Tensor, int, torch.dtype], torch.Tensor] | None = None,
):
    """The weight as a (rows, cols) tensor, as ggml dequantizes it (float32, the default: its
    values bit for bit; float64: every value exact, for the kernels' references). ``groups``:
    what dequantizes a paired weight's interleaved groups of rows (``dequantize_paired``; the
    CPU kernels' ``CpuOps.dequantize`` passes its C one), torch's by default."""
    if isinstance(weight, StackedWeight):
        return torch.cat([dequantize(p, dtype, groups) for p in weight.parts])
    if weight.paired:
        from kvmesh.shared.model.quant_paired import dequantize_paired

        return dequantize_paired(weight, dtype, groups)
    fmt, rows, cols = weight.format, weight.rows, weight.cols
    if fmt in FLOAT_FORMATS:
        half = torch.float16 if fmt == "F16" else torch.bfloat16
        return weight.data.view(half).to(dtype).reshape(rows, cols)
    blocks = weight.data.view(rows, cols // BLOCK_VALUES[fmt], BLOCK_BYTES[fmt])
    if fmt in K_FORMATS:
        return _dequantize_k(fmt, blocks, dtype).reshape(rows, cols)
    d = _f16(blocks, 0).to(dtype)
    if fmt == "Q8_0":
        values = d * blocks[..., 2:].contiguous().view(torch.int8).to(dtype)
    elif fmt == "Q4_0":
        values = d * (_nibbles(blocks[..., 2:]).to(dtype) - 8)
    elif fmt == "Q4_1":
        values = d * _nibbles(blocks[..., 4:]).to(dtype) + _f16(blocks, 2).to(dtype)
    elif fmt == "Q5_0":
        values = d * (_five_bits(blocks[..., 2:6], blocks[..., 6:]).to(dtype) - 16)
    else:  # Q5_1
        q = _five_bits(blocks[..., 4:8], blocks[..., 8:]).to(dtype)
        values = d * q + _f16(blocks, 2).to(dtype)
    return values.reshape(rows, cols)


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5's values 0..31 (..., 32): the nibbles of qs (..., 16), bit j of qh (..., 4) the fifth
    bit of value j."""
    high = (qh.unsqueeze(-1) >> _shifts(*range(8)).view(8)) & 1  # (..., 4, 8): byte, bit
    return _nibbles(qs) | (high.flatten(-2) << 4)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes (..., 12) -> 6-bit scales sc and mins m, (..., 8) each:
    j < 4: sc = s[j] & 63, m = s[j + 4] & 63; else the low 4 bits in s[j + 4] (sc low nibble,
    m high), the top 2 in the top bits of s[j - 4] (sc) and s[j] (m)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], -1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], -1)
    return sc, mn


def _k_terms(fmt: str, blocks: torch.Tensor, dtype: torch.dtype):
    """(q, dq, mq) of K-quant super-blocks (..., bytes): q (..., 8, 32) the stored integers
    (Q6_K: minus 32), dq (..., 8, 32 or 2, 16 ...) broadcastable scale, mq the min (Q6_K: 0)."""
    if fmt == "Q6_K":
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        sc = blocks[..., 192:208].contiguous().view(torch.int8).to(dtype)
        d = _f16(blocks, 208).to(dtype)
        low = ql.reshape(*ql.shape[:-1], 2, 1, 64) >> _shifts(0, 4)
        low = (low & 0x0F).reshape(*ql.shape[:-1], 8, 32)
        high = qh.reshape(*qh.shape[:-1], 2, 1, 32) >> _shifts(0, 2, 4, 6)
        high = (high & 0x03).reshape(*qh.shape[:-1], 8, 32)
        q = (low | (high << 4)).to(dtype) - 32
        scale = (d * sc).reshape(*sc.shape[:-1], 8, 2, 1)
        return q.reshape(*q.shape[:-1], 2, 16), scale, None
    d, dmin = _f16(blocks, 0).to(dtype), _f16(blocks, 2).to(dtype)
    sc, mn = _k_scales(blocks[..., 4:16])
    qs = blocks[..., -128:]
    q = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> _shifts(0, 4)
    q = (q & 0x0F).reshape(*qs.shape[:-1], 8, 32)
    if fmt == "Q5_K":
        qh = blocks[..., 16:48]
        high = qh.unsqueeze(-2) >> _shifts(*range(8))
        q = q | ((high & 1) << 4)
    return q.to(dtype), (d * sc.to(dtype)).unsqueeze(-1), (dmin * mn.to(dtype)).unsqueeze(-1)


def _shifts(*bits: int) -> torch.Tensor:
    """Right-shift counts (len(bits), 1): each byte row shifted by each, along a new axis."""
    return torch.tensor(bits, dtype=torch.uint8).view(-1, 1)


def _dequantize_k(fmt: str, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    q, scale, mins = _k_terms(fmt, blocks, dtype)
    values = scale * q if mins is None else scale * q - mins
    return values.reshape(*blocks.shape[:-1], 256)


def quantize(weight: torch.Tensor, format: str) -> QuantWeight:
    """A float (rows, cols) weight in ``format`` (a ``QUANT_FORMATS`` one or F16, BF16), bit for
    bit as gguf's (and ggml's reference) quantizers write it: scales computed in float32,
    stored as float16; floats rounded to nearest even. (The K-quants' quantizers search their
    scales; kvmesh only reads K-quant files.)"""
    assert format in QUANT_FORMATS + FLOAT_FORMATS, f"cannot quantize to {format!r}"
    rows, cols = weight.shape
    if format in FLOAT_FORMATS:
        half = torch.float16 if format == "F16" else torch.bfloat16
        data = weight.detach().float().to(half).contiguous().view(torch.uint8)
        return QuantWeight(format, data.reshape(rows, 2 * cols), rows, cols)
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
    elif format == "Q5_0":
        imax = x.abs().argmax(-1, keepdim=True)
        d = x.gather(-1, imax) / -16
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = (x * inv + 16.5).trunc().clamp(0, 31).to(torch.uint8)
        parts = [_as_f16_bytes(d), _pack_fifth_bits(q), _pack_nibbles(q & 0x0F)]
    else:  # Q4_1, Q5_1
        levels = 15 if format == "Q4_1" else 31
        hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
        d = (hi - lo) / levels
        inv = torch.where(d == 0, 0.0, 1 / d)
        q = ((x - lo) * inv + 0.5).trunc().clamp(0, levels).to(torch.uint8)
        parts = [_as_f16_bytes(d), _as_f16_bytes(lo)]
        if format == "Q5_1":
            parts.append(_pack_fifth_bits(q))
        parts.append(_pack_nibbles(q & 0x0F))
    data = torch.cat(parts, dim=-1).reshape(rows, -1).contiguous()
    return QuantWeight(format, data, rows, cols)


def _as_f16_bytes(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.float16).view(torch.uint8)


def _pack_fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """(..., 32) values 0..31 -> (..., 4) bytes: bit j of the little-endian uint32 is q[j] >> 4."""
    bits = (q >> 4).reshape(*q.shape[:-1], 4, 8) << _shifts(*range(8)).view(8)
    return bits.sum(-1, dtype=torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return q[..., :16] | (q[..., 16:] << 4)
