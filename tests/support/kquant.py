"""K-quant weights for tests: a plain round-to-nearest quantizer to Q4_K, Q5_K and Q6_K, the
inverse of ``shared/model/quant.py``'s dequantize (llama.cpp's own quantizers search their
scales; kvmesh only reads the format, so any valid blocks do), and random valid blocks (every
bit pattern of the scales and values)."""

from __future__ import annotations

import torch
from kvmesh.shared.model.quant import BLOCK_BYTES, QuantWeight, row_bytes


def _f16(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values rounded to float16: (as float32, as bytes (..., 2))."""
    half = values.to(torch.float16)
    return half.float(), half.contiguous().view(torch.uint8).reshape(*values.shape[:-1], -1)


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """(..., 8) 6-bit scales and mins -> Q4_K's 12 bytes (the inverse of quant._k_scales)."""
    lo_sc, hi_sc, lo_m, hi_m = sc[..., :4], sc[..., 4:], mn[..., :4], mn[..., 4:]
    return torch.cat(
        [
            lo_sc | ((hi_sc >> 4) << 6),
            lo_m | ((hi_m >> 4) << 6),
            (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4),
        ],
        -1,
    )


def quantize_k(weight: torch.Tensor, format: str) -> QuantWeight:
    """A float (rows, cols) weight, cols a multiple of 256, as ``format`` blocks."""
    rows, cols = weight.shape
    assert cols % 256 == 0, cols
    x = weight.detach().float().reshape(rows, cols // 256, 256)
    if format == "Q6_K":
        sub = x.reshape(*x.shape[:2], 16, 16)
        imax = sub.abs().argmax(-1, keepdim=True)
        scale = sub.gather(-1, imax).squeeze(-1) / -32  # the largest value maps to -32
        d, d_bytes = _f16(scale.abs().amax(-1, keepdim=True) / 127)
        inv_d = torch.where(d == 0, 0.0, 1 / d)
        sc = (scale * inv_d).round().clamp(-128, 127)
        step = (d * sc).unsqueeze(-1)
        q = torch.where(step == 0, 0.0, sub / step).round().clamp(-32, 31) + 32
        q = q.to(torch.uint8).reshape(*x.shape[:2], 2, 4, 32)  # half, group of 32, i
        lo = q & 0x0F
        ql = torch.cat(
            [lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)], -1
        )
        hb = q >> 4
        qh = hb[..., 0, :] | (hb[..., 1, :] << 2) | (hb[..., 2, :] << 4) | (hb[..., 3, :] << 6)
        parts = [ql.flatten(-2), qh.flatten(-2), sc.to(torch.int8).view(torch.uint8), d_bytes]
    else:
        nmax = 15 if format == "Q4_K" else 31
        sub = x.reshape(*x.shape[:2], 8, 32)
        lo = (-sub.amin(-1)).clamp(min=0)  # the min is subtracted: m >= 0
        scale = (sub.amax(-1) + lo) / nmax
        d, d_bytes = _f16(scale.amax(-1, keepdim=True) / 63)
        dmin, dmin_bytes = _f16(lo.amax(-1, keepdim=True) / 63)
        sc = torch.where(d == 0, 0.0, scale / d).round().clamp(0, 63).to(torch.uint8)
        mn = torch.where(dmin == 0, 0.0, lo / dmin).round().clamp(0, 63).to(torch.uint8)
        step = (d * sc.float()).unsqueeze(-1)
        offset = (dmin * mn.float()).unsqueeze(-1)
        q = torch.where(step == 0, 0.0, (sub + offset) / step).round().clamp(0, nmax)
        q = q.to(torch.uint8)  # (rows, super-blocks, 8, 32)
        nibbles = (q[..., 0::2, :] & 0x0F) | ((q[..., 1::2, :] & 0x0F) << 4)
        parts = [d_bytes, dmin_bytes, _pack_k_scales(sc, mn)]
        if format == "Q5_K":
            bits = (q >> 4) << torch.arange(8, dtype=torch.uint8).view(8, 1)
            parts.append(bits.sum(-2, dtype=torch.uint8))  # bit j: sub-block j's fifth bit
        parts.append(nibbles.flatten(-2))
    data = torch.cat(parts, -1).reshape(rows, row_bytes(format, cols)).contiguous()
    return QuantWeight(format, data, rows, cols)


def random_k(format: str, rows: int, cols: int, seed: int, scale: float = 0.002) -> QuantWeight:
    """Random ``format`` blocks: every byte random but the float16 scales (d, dmin), ``scale``."""
    g = torch.Generator().manual_seed(seed)
    size = BLOCK_BYTES[format]
    raw = torch.randint(0, 256, (rows, cols // 256, size), generator=g, dtype=torch.uint8)
    half = torch.tensor([scale], dtype=torch.float16).view(torch.uint8)
    if format == "Q6_K":
        raw[..., size - 2 :] = half
    else:
        raw[..., 0:2] = half
        raw[..., 2:4] = half
    return QuantWeight(format, raw.reshape(rows, -1).contiguous(), rows, cols)
