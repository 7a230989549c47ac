"""The paired layout of Q4, Q5 and Q8_0 weights (``QuantWeight.paired``), the one the VNNI
kernels (kernels/cpu_quant.c) read fastest, and its way back to the GGUF layout of quant.py.

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
from collections.abc import Callable

import torch
from kvmesh.shared.model.quant import (
    GROUP,
    PAIRABLE,
    QuantWeight,
    StackedWeight,
    _nibbles,
    _pack_nibbles,
    _shifts,
    dequantize,
)
from kvmesh.shared.model.quant_formats import BLOCK, BLOCK_BYTES, row_bytes


def dequantize_paired(
    weight: QuantWeight,
    dtype: torch.dtype,
    groups: Callable[[str, torch.Tensor, int, torch.dtype], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``dequantize`` of a paired weight: its groups read as they are (a prefill chunk
    dequantizes every weight) by ``groups`` (``_dequantize_groups``'s arguments; it by default),
    the rows left over put back in the GGUF layout first."""
    grouped = weight.rows // GROUP * GROUP
    if not grouped:
        return dequantize(unpair_blocks(weight), dtype)
    rest = QuantWeight(
        weight.format, weight.data[grouped:], weight.rows - grouped, weight.cols, True
    )
    head = (groups or _dequantize_groups)(weight.format, weight.data[:grouped], weight.cols, dtype)
    if not rest.rows:
        return head
    return torch.cat([head, dequantize(unpair_blocks(rest), dtype)])


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


def paired_rows(weight: QuantWeight, index: torch.Tensor) -> torch.Tensor:
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
