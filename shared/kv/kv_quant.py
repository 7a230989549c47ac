"""FP8 (e4m3) KV quantization: the scale rule, storing new tokens, reading blocks back.

A KV pool of ``torch.float8_e4m3fn`` keeps one float32 scale per (block, KV head, layer, K/V)
(``KVPool.scales``); a stored element means ``fp8 * scale``. The scale of a tile is a power of
two, the smallest with ``amax / scale <= 448`` (e4m3's largest finite value) over every token
stored in the tile so far:

* A write that starts a block (a token at slot 0) sets the scale from the new tokens alone.
* A write into a block that already holds tokens keeps the scale when the new tokens fit, and
  otherwise grows it and requantizes the tile's stored tokens to the new scale first. Nothing is
  ever clipped, whatever order a block fills in; and since the ratio of two scales is a power of
  two, requantizing is exact (bar values pushed below e4m3's smallest subnormal, 2**-9 of the
  scale, i.e. more than 2**17 below the tile's largest value).

The CPU kernels (``kernels/cpu_ops.c``) and the Triton kernels read the same bytes and scales;
``e4m3_lut`` is the table they decode fp8 with, the values torch itself decodes to.
"""

from __future__ import annotations

import functools

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
MIN_SCALE = 2.0**-30  # the scale of an all-zero tile: any later token grows it


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s >= MIN_SCALE`` with ``amax / s <= FP8_MAX`` (float32)."""
    s = (amax.float() / FP8_MAX).clamp_min(MIN_SCALE)
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    scale = torch.ldexp(torch.ones_like(s), exponent)
    # amax / FP8_MAX may have rounded down onto a power of two
    return torch.where(amax.float() > scale * FP8_MAX, scale * 2, scale)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn, saturating at +-448 (a plain cast would give NaN past it)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def store(
    data: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    *,
    starts_blocks: bool = True,
) -> None:
    """Quantize ``values`` into slots ``(blocks[t], offsets[t])`` of ``data``, growing and
    requantizing scales as needed.

    data: (num_blocks, block_size, *R, D) fp8 (any strides); scales: (num_blocks, *R) float32;
    values: (T, *R, D); blocks, offsets: (T,) int64. ``R`` is (H_kv,) for one layer's K or V.
    With ``starts_blocks`` a token at slot 0 starts its block afresh (its old scale is stale);
    without it (moving tokens within a sequence) every block keeps what it holds.
    """
    if values.shape[0] == 0:
        return
    amax = values.detach().abs().amax(-1).float()  # (T, *R)
    touched, inverse = torch.unique(blocks, return_inverse=True)  # (U,), (T,)
    index = inverse.view(-1, *([1] * (amax.dim() - 1))).expand_as(amax)
    block_amax = amax.new_zeros((touched.numel(), *amax.shape[1:]))
    block_amax.scatter_reduce_(0, index, amax, "amax")
    old = scales[touched]  # (U, *R)
    if starts_blocks:
        started = torch.zeros(touched.numel(), dtype=torch.bool, device=blocks.device)
        started[inverse[offsets == 0]] = True
        old = torch.where(started.view(-1, *([1] * (old.dim() - 1))), 0.0, old)
    new = torch.maximum(old, pow2_scale(block_amax))
    grown = ((new > old) & (old > 0)).flatten(1).any(1)  # blocks whose tokens need rescaling
    if bool(grown.any()):
        ids = touched[grown]
        ratio = (old[grown] / new[grown]).unsqueeze(1).unsqueeze(-1)  # (G, 1, *R, 1)
        data[ids] = quantize(data[ids].float() * ratio)
    scales[touched] = new
    data[blocks, offsets] = quantize(values.float() / new[inverse].unsqueeze(-1))


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of fp8 ``data`` (..., D) with ``scales`` broadcast over its last dim."""
    return data.float() * scales.unsqueeze(-1)


def move_token(pool_tensor: torch.Tensor, scales: torch.Tensor, src: tuple, dst: tuple) -> None:
    """Copy one token's K and V (every head and layer) from slot ``src = (block, offset)`` to
    ``dst`` of an fp8 pool; pool_tensor (N, H, L, 2, bs, D), scales (N, H, L, 2). Within one
    block the bytes move as they are; across blocks the value is requantized to the
    destination's scale (grown if it must be)."""
    (sb, so), (db, do) = src, dst
    if sb == db:
        pool_tensor[db, :, :, :, do] = pool_tensor[sb, :, :, :, so]
        return
    data = pool_tensor.permute(0, 4, 1, 2, 3, 5)  # (N, bs, H, L, 2, D)
    value = dequantize(data[sb, so], scales[sb])  # (H, L, 2, D)
    device = pool_tensor.device
    store(
        data,
        scales,
        value.unsqueeze(0),
        torch.tensor([db], device=device),
        torch.tensor([do], device=device),
        starts_blocks=False,
    )


def e4m3_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """(256,) float32: the value of each e4m3fn byte (0x7f and 0xff are NaN); one per device."""
    return _lut(str(torch.device(device)))


@functools.cache
def _lut(device: str) -> torch.Tensor:
    lut = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    return lut.to(device)
