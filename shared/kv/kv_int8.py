"""INT8 KV quantization: one float32 scale per 32 values of a token (llama.cpp's q8_0 grouping),
each group first rotated by a normalized 32-point Walsh-Hadamard transform.

A KV pool of ``torch.int8`` keeps, for every stored token of every (KV head, layer, K/V), one
float32 scale per group of ``GROUP`` consecutive head-dim values (``KVPool.scales``:
(num_blocks, H_kv, L, 2, block_size, D // GROUP)). A stored group means ``rotate(int8 * scale)``.

The rule, the same in torch, C and every reader: a group is rotated (``rotate``: butterflies in a
fixed order, then times 32**-0.5, float32), its scale is ``amax / 127`` of the rotated values
(float32 division), its values ``round(y / scale)`` (IEEE division, round half to even) clamped
to ``[-127, 127]``; an all-zero group has scale 0 and values 0. A token's bytes depend on that
token alone, so unlike fp8's per-block scales nothing is ever requantized: writing a block token
by token, in chunks or at once gives the same bytes, a token moves between slots with its scales,
and a rolled-back draft leaves no trace in the tokens kept.

Why: SmolLM2-135M's keys carry a few channels far larger than the rest. With one scale per 32
values such a channel sets its group's step and the other 31 values keep a few levels; the
rotation spreads it over the group (an orthogonal map: the error's size is unchanged by rotating
back), which cut SmolLM2's mean logit error by a third and its largest by half
(docs/kv_cache.md). 32 values are 32 bytes plus a
4-byte scale: 1.125 bytes per value, against 1 for fp8 and 2 for bf16.
"""

from __future__ import annotations

import functools

import torch

INT8_DTYPE = torch.int8
GROUP = 32  # head-dim values per scale (llama.cpp's q8_0 block)
INT8_MAX = 127.0
_HADAMARD_SCALE = torch.tensor(GROUP**-0.5)  # float32: the normalized transform's factor


def rotate(x: torch.Tensor) -> torch.Tensor:
    """(..., D) float32 -> the normalized Walsh-Hadamard transform of each group of GROUP values
    (its own inverse), as butterflies in the order the C kernels run them (bit for bit)."""
    shape = x.shape
    g = x.reshape(-1, GROUP)
    h = 1
    while h < GROUP:
        pairs = g.view(-1, GROUP // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        g = torch.stack((a + b, a - b), dim=2).view(-1, GROUP)
        h *= 2
    return (g * _HADAMARD_SCALE.to(g.device)).view(shape)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values (..., D) -> (int8 (..., D), float32 scales (..., D // GROUP)) of the rotated
    values."""
    groups = rotate(values.float().contiguous()).unflatten(-1, (-1, GROUP))  # (..., G, GROUP)
    scales = groups.abs().amax(-1) / INT8_MAX  # (..., G)
    safe = torch.where(scales > 0, scales, 1.0)
    q = torch.round(groups / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return q.flatten(-2).to(INT8_DTYPE), scales


def dequantize(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of int8 ``data`` (..., D) with ``scales`` (..., D // GROUP): each group
    times its scale, rotated back."""
    return rotate(dequantize_rotated(data, scales))


def dequantize_rotated(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The rotated values (``rotate`` of what ``dequantize`` gives): int8 times scale."""
    groups = data.float().unflatten(-1, (-1, GROUP)) * scales.unsqueeze(-1)
    return groups.flatten(-2).contiguous()


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


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(D, D) float32: the block-diagonal matrix of ``rotate`` (symmetric, its own inverse), so
    ``x @ M == rotate(x)`` up to float rounding; one per (D, device). The Triton kernel rotates
    queries and outputs with it instead of every stored token."""
    return _rotation(head_dim, str(torch.device(device)))


@functools.cache
def _rotation(head_dim: int, device: str) -> torch.Tensor:
    return rotate(torch.eye(head_dim)).to(device)
