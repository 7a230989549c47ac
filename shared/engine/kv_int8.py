"""INT8 KV quantization: one float32 scale per 32 values of a token (llama.cpp's q8_0 grouping).

A KV pool of ``torch.int8`` keeps, for every stored token of every (KV head, layer, K/V), one
float32 scale per group of ``GROUP`` consecutive head-dim values (``KVPool.scales``:
(num_blocks, H_kv, L, 2, block_size, D // GROUP)); a stored element means ``int8 * scale``.

The rule, the same in torch, C and every reader: a group's scale is ``amax / 127`` (float32
division), its values ``round(x / scale)`` (IEEE division, round half to even) clamped to
``[-127, 127]``; an all-zero group has scale 0 and values 0. A token's bytes depend on that token
alone, so unlike fp8's per-block scales nothing is ever requantized: writing a block token by
token, in chunks or at once gives the same bytes, a token moves between slots with its scales,
and a rolled-back draft leaves no trace in the tokens kept.

Why per 32 values rather than per token: SmolLM2-135M's keys carry a few large channels; one
scale per 64-value head row gave the float32 greedy output on 73% of generated tokens, one per
32 values on 99.5% (docs/kv_cache.md). 32 values are 32 bytes plus a 4-byte scale: 1.125 bytes
per value, against 1 for fp8 and 2 for bf16.
"""

from __future__ import annotations

import torch

INT8_DTYPE = torch.int8
GROUP = 32  # head-dim values per scale (llama.cpp's q8_0 block)
INT8_MAX = 127.0


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (..., D) -> (int8 (..., D), float32 scales (..., D // GROUP))."""
    groups = values.float().unflatten(-1, (-1, GROUP))  # (..., G, GROUP)
    scales = groups.abs().amax(-1) / INT8_MAX  # (..., G)
    safe = torch.where(scales > 0, scales, 1.0)
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return q.flatten(-2).to(INT8_DTYPE), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of int8 ``data`` (..., D) with ``scales`` (..., D // GROUP)."""
    groups = data.float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)
    return groups.flatten(-2)


def store(
    data: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Quantize ``values`` into slots ``(blocks[t], offsets[t])``.

    data: (num_blocks, block_size, *R, D) int8 (any strides); scales: (num_blocks, block_size,
    *R, D // GROUP) float32; values: (T, *R, D); blocks, offsets: (T,) int64.
    """
    if values.shape[0] == 0:
        return
    q, s = quantize(values.detach())
    data[blocks, offsets] = q
    scales[blocks, offsets] = s


def move_token(pool_tensor: torch.Tensor, scales: torch.Tensor, src: tuple, dst: tuple) -> None:
    """Copy one token's K and V (every head and layer) with its scales from slot
    ``src = (block, offset)`` to ``dst``; pool_tensor (N, H, L, 2, bs, D), scales
    (N, H, L, 2, bs, D // GROUP)."""
    (sb, so), (db, do) = src, dst
    pool_tensor[db, :, :, :, do] = pool_tensor[sb, :, :, :, so]
    scales[db, :, :, :, do] = scales[sb, :, :, :, so]
