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

``pair_blocks`` rewrites a Q4, Q5 or Q8_0 weight's rows in the layout the VNNI kernels read
fastest (``paired``). The rows in whole groups of 16 (``GROUP``; the first ``rows // 16 * 16``)
are interleaved: for each block b of the row, the group's 16 scales d (float16), for Q4_1 and
Q5_1 its 16 m, for Q5 8 masks of 64 bits (bit 4c + t of mask j: row c's value 4j + t's fifth
bit), then chunks of 64 bytes, chunk i's bytes 4c .. 4c + 4 being row c's value bytes 4i .. 4i +
4 (Q4, Q5: nibble bytes; Q8_0: q + 128, unsigned), so that one ``vpdpbusd`` lane holds one row.
The Q4 rows left over are paired: each pair of blocks A, B as dA, dB (mA, mB for Q4_1), then 32
bytes, byte j holding A's value j in its low nibble and B's value j in its high one; a last
unpaired block stays as it was (Q5's and Q8_0's rows left over: as in the file). The same bytes
and the same values: ``dequantize`` reads both; a group's rows are not separable
(``select_rows`` and ``cat_rows`` return the GGUF layout).
"""

from __future__ import annotations

import functools
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
        data = _paired_rows(self, index) if self.paired else self.data.index_select(0, index)
        return QuantWeight(self.format, data, index.numel(), self.cols)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.format, self.data.to(device), self.rows, self.cols, self.paired)


def cat_rows(weights: list[QuantWeight]) -> QuantWeight | StackedWeight:
    """Weights of one width stacked along rows (q, k, v into one projection): one QuantWeight
    where they share a format, else a ``StackedWeight`` of copies of them (in the GGUF layout)."""
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


def _pair_view(weight: QuantWeight) -> tuple[torch.Tensor, int]:
    """The rows' whole pairs of blocks (rows, pairs, 2 * block bytes), and the number of pairs."""
    bb = BLOCK_BYTES[weight.format]
    pairs = weight.cols // BLOCK // 2
    return weight.data[:, : pairs * 2 * bb].view(weight.rows, pairs, 2 * bb), pairs  # a view


def _interleave(fmt: str, rows: torch.Tensor, cols: int) -> torch.Tensor:
    """GGUF rows (groups * GROUP, row bytes) -> the same bytes interleaved by groups (above)."""
    nb, bb, head, vals = cols // BLOCK, BLOCK_BYTES[fmt], *_block_offsets(fmt)
    blocks = rows.view(-1, GROUP, nb, bb).transpose(1, 2)  # (groups, nb, GROUP, bb)
    lead = blocks.shape[:2]
    scales = [blocks[..., i : i + 2] for i in range(0, head, 2)]  # d (and m) of each row
    qs = blocks[..., vals:].reshape(*lead, GROUP, (bb - vals) // 4, 4).transpose(2, 3)
    if fmt == "Q8_0":
        qs = qs ^ 0x80  # q + 128: unsigned
    fifth = []  # Q5: chunk j's fifth bits, bit 4c + t of mask j = row c's value 4j + t
    if vals > head:
        bits = _bits(blocks[..., head:vals]).reshape(*lead, GROUP, 8, 4).transpose(2, 3)
        fifth = [_pack_bits(bits.reshape(*lead, 8, 4 * GROUP))]
    parts = [t.reshape(*lead, -1) for t in [*scales, *fifth, qs]]
    return torch.cat(parts, -1).reshape(rows.shape)


def _deinterleave(fmt: str, rows: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of ``_interleave``."""
    nb, bb, head, vals = cols // BLOCK, BLOCK_BYTES[fmt], *_block_offsets(fmt)
    view = rows.view(-1, nb, GROUP * bb)
    lead = view.shape[:2]
    scales = [
        view[..., GROUP * i : GROUP * (i + 2)].reshape(*lead, GROUP, 2) for i in range(0, head, 2)
    ]
    start = GROUP * vals
    fifth = []
    if vals > head:
        bits = _bits(view[..., GROUP * head : start]).reshape(*lead, 8, GROUP, 4).transpose(2, 3)
        fifth = [_pack_bits(bits.reshape(*lead, GROUP, 32))]
    qs = view[..., start:].reshape(*lead, (bb - vals) // 4, GROUP, 4).transpose(2, 3)
    if fmt == "Q8_0":
        qs = qs ^ 0x80
    blocks = torch.cat([*scales, *fifth, qs.reshape(*lead, GROUP, bb - vals)], -1)
    return blocks.transpose(1, 2).reshape(rows.shape)  # (groups, nb, GROUP, bb) as rows


def _block_offsets(fmt: str) -> tuple[int, int]:
    """Where a block's scales end and its values start (Q5: its fifth bits between)."""
    head = 4 if fmt in ("Q4_1", "Q5_1") else 2
    return head, head + (4 if fmt in ("Q5_0", "Q5_1") else 0)


def _bits(data: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 8 n) bits, little-endian."""
    return ((data.unsqueeze(-1) >> _shifts(*range(8)).view(8)) & 1).flatten(-2)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 8 n) bits -> (..., n) bytes (the inverse of ``_bits``)."""
    shaped = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8).to(torch.uint8)
    shaped = shaped << _shifts(*range(8)).view(8)
    return shaped.sum(-1, dtype=torch.uint8)


def _paired_rows(weight: QuantWeight, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a paired weight in the GGUF layout: only the groups holding them are
    read back (an embedding lookup), a few hundred at a time; each row's bytes gathered through
    ``_group_gather``'s map (Q5: its groups put back whole)."""
    fmt, grouped, rb = weight.format, weight.rows // GROUP * GROUP, weight.data.shape[1]
    if grouped == 0 or bool((index >= grouped).any()):  # a row left over: the slow way
        return unpair_blocks(weight).data.index_select(0, index)
    groups = weight.data[:grouped].view(-1, GROUP * rb)
    if fmt.startswith("Q5"):  # its fifth bits are spread over bytes: groups put back whole
        out = []
        for start in range(0, index.numel(), 256):
            idx = index[start : start + 256]
            g = groups.index_select(0, idx // GROUP)
            rows = _deinterleave(fmt, g.view(-1, rb), weight.cols).view(-1, GROUP, rb)
            out.append(rows[torch.arange(idx.numel(), device=idx.device), idx % GROUP])
        return torch.cat(out) if out else weight.data[:0]
    src, flip = _group_gather(fmt, weight.cols, str(weight.data.device))
    row = index % GROUP
    picked = groups.view(-1)[((index - row) * rb).unsqueeze(1) + src[row]]
    return picked ^ flip[row] if fmt == "Q8_0" else picked


@functools.lru_cache(maxsize=32)
def _group_gather(fmt: str, cols: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each byte of a group's GGUF rows comes from in its paired bytes (GROUP, row bytes),
    and what to xor it with after (Q8_0's 0x80): ``_deinterleave`` of the positions themselves,
    written in base-256 digits (a Q4 or Q8_0 group is a permutation of its bytes)."""
    rb = row_bytes(fmt, cols)
    position = torch.arange(GROUP * rb, dtype=torch.int64)
    flip = _deinterleave(fmt, torch.zeros(GROUP, rb, dtype=torch.uint8), cols)
    src = torch.zeros(GROUP, rb, dtype=torch.int64)
    for k in range(3):  # up to 2^24 bytes a group
        digit = ((position >> (8 * k)) & 255).to(torch.uint8).view(GROUP, rb)
        src += (_deinterleave(fmt, digit, cols) ^ flip).to(torch.int64) << (8 * k)
    return src.to(device), flip.to(device)


def pair_blocks(weight: QuantWeight | StackedWeight, in_place: bool = False):
    """A Q4 weight in the paired layout (the module docstring); any other is returned as is (a
    stacked weight: its Q4 parts paired). ``in_place``: rewrite ``weight.data`` itself (no
    second copy stays resident; ``weight`` must not be used afterwards), a few rows at a time."""
    if isinstance(weight, StackedWeight):
        return StackedWeight(tuple(pair_blocks(p, in_place) for p in weight.parts))
    if weight.paired or weight.format not in PAIRABLE:
        return weight
    fmt, head = weight.format, _block_offsets(weight.format)[0]
    data = weight.data if in_place else weight.data.clone()
    grouped = weight.rows // GROUP * GROUP
    step = 256  # rows at a time: the temporaries stay small
    for r in range(0, grouped, step):
        rows = data[r : min(r + step, grouped)]
        rows.copy_(_interleave(fmt, rows, weight.cols))
    rest = data[grouped:]
    if fmt not in ("Q4_0", "Q4_1"):  # Q8_0's and Q5's rows left over keep the GGUF layout
        return QuantWeight(fmt, data, weight.rows, weight.cols, paired=True)
    view, _ = _pair_view(QuantWeight(fmt, rest, rest.shape[0], weight.cols))
    a, b = view[..., : view.shape[-1] // 2], view[..., view.shape[-1] // 2 :]
    scales = [a[..., :2], b[..., :2]] + ([a[..., 2:4], b[..., 2:4]] if head == 4 else [])
    values = _nibbles(a[..., head:]) | (_nibbles(b[..., head:]) << 4)
    view.copy_(torch.cat([*scales, values], -1))
    return QuantWeight(fmt, data, weight.rows, weight.cols, paired=True)


def unpair_blocks(weight: QuantWeight | StackedWeight):
    """A weight in the GGUF layout (the inverse of ``pair_blocks``)."""
    if isinstance(weight, StackedWeight):
        return StackedWeight(tuple(unpair_blocks(p) for p in weight.parts))
    if not weight.paired:
        return weight
    fmt, head = weight.format, _block_offsets(weight.format)[0]
    grouped = weight.rows // GROUP * GROUP
    data = weight.data.clone()
    data[:grouped] = _deinterleave(fmt, weight.data[:grouped], weight.cols)
    rest = data[grouped:]
    if fmt not in ("Q4_0", "Q4_1"):
        return QuantWeight(fmt, data, weight.rows, weight.cols)
    view, _ = _pair_view(QuantWeight(fmt, rest, rest.shape[0], weight.cols))
    values = view[..., 2 * head :]
    low, high = values & 0x0F, values >> 4  # A's 32 values, B's
    s = view[..., : 2 * head]
    a_scales = [s[..., 0:2]] + ([s[..., 4:6]] if head == 4 else [])
    b_scales = [s[..., 2:4]] + ([s[..., 6:8]] if head == 4 else [])
    view.copy_(torch.cat([*a_scales, _pack_nibbles(low), *b_scales, _pack_nibbles(high)], -1))
    return QuantWeight(fmt, data, weight.rows, weight.cols)


def dequantize(weight: QuantWeight | StackedWeight, dtype: torch.dtype = torch.float32):
    """The weight as a (rows, cols) tensor, as ggml dequantizes it (float32, the default: its
    values bit for bit; float64: every value exact, for the kernels' references)."""
    if isinstance(weight, StackedWeight):
        return torch.cat([dequantize(p, dtype) for p in weight.parts])
    grouped = weight.rows // GROUP * GROUP if weight.paired else 0
    if grouped:  # the groups read as they are (a prefill chunk dequantizes every weight)
        rest = QuantWeight(
            weight.format, weight.data[grouped:], weight.rows - grouped, weight.cols, True
        )
        head = _dequantize_groups(weight.format, weight.data[:grouped], weight.cols, dtype)
        return torch.cat([head, dequantize(rest, dtype)]) if rest.rows else head
    weight = unpair_blocks(weight)
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


def _dequantize_groups(fmt: str, rows: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Interleaved groups of rows (the module docstring) as values, read in place: the integers
    put in row order as bytes, then scaled."""
    nb, bb, head, vals = cols // BLOCK, BLOCK_BYTES[fmt], *_block_offsets(fmt)
    view = rows.view(-1, nb, GROUP * bb)
    lead = view.shape[:2]

    def scale(i: int) -> torch.Tensor:  # (groups, GROUP, nb, 1, 1): d (i = 0) or m (i = 1)
        part = view[..., 2 * GROUP * i : 2 * GROUP * (i + 1)].contiguous().view(torch.float16)
        return part.view(*lead, GROUP).transpose(1, 2).to(dtype).unsqueeze(-1).unsqueeze(-1)

    q = view[..., GROUP * vals :].reshape(*lead, -1, GROUP, 4)  # chunk, row, byte
    if fmt == "Q8_0":
        q = (q ^ 0x80).view(torch.int8)
    else:
        q = torch.cat([q & 0x0F, q >> 4], 2)  # (groups, nb, 8, GROUP, 4): values 4j + t
        if vals > head:  # Q5: mask j's bit 4c + t
            q = q | (_bits(view[..., GROUP * head : GROUP * vals]).view(*lead, 8, GROUP, 4) << 4)
    q = q.permute(0, 3, 1, 2, 4).to(dtype)  # (groups, GROUP, nb, 8, 4): rows in order
    offset = {"Q4_0": -8, "Q5_0": -16}.get(fmt)
    if fmt == "Q8_0":
        values = scale(0) * q
    elif offset is None:
        values = scale(0) * q + scale(1)
    else:
        values = scale(0) * (q + offset)
    return values.reshape(-1, cols)


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
