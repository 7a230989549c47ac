"""KV data plane pack/scatter: move a head range of whole blocks between a pool and a staging buffer.

A pool is ``(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)``. When prefill and
decode run at different tensor-parallel degrees, a prefill rank holds a different head slice than
the decode rank that needs it, so a block cannot move as one span: the sender packs the head range
of its blocks into a contiguous staging tensor ``(n, num_layers, 2, block_size, num_heads, head_dim)``
and the receiver scatters it into its own blocks at its head offset. ``reshard_plan`` says which
pieces go where. The kernels copy raw bits (elements viewed as same-width integers), so one kernel
serves fp32, bf16, fp16 and fp8 alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE_ELEMS = 4096  # elements one program copies at most


class ReshardPiece(NamedTuple):
    """One head range a source (prefill) rank sends to one destination (decode) rank.

    ``src_heads`` is ``(start, end)`` in the source rank's local head numbering (the arguments of
    ``pack_blocks``); ``dst_head_offset`` is where it lands in the destination rank's local heads
    (the ``head_start`` of ``scatter_blocks``).
    """

    dst_rank: int
    src_heads: tuple[int, int]
    dst_head_offset: int


def reshard_plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[list[ReshardPiece]]:
    """For each source rank, the pieces it must write when KV heads move from TP ``src_tp`` to
    ``dst_tp``. Rank r of a TP degree t holds heads ``[r * H / t, (r + 1) * H / t)``."""
    if num_kv_heads <= 0 or src_tp <= 0 or dst_tp <= 0:
        raise ValueError(
            f"num_kv_heads, src_tp and dst_tp must be positive, got {num_kv_heads}, {src_tp}, {dst_tp}"
        )
    for name, tp in (("src_tp", src_tp), ("dst_tp", dst_tp)):
        if num_kv_heads % tp != 0:
            raise ValueError(f"{num_kv_heads} KV heads do not split evenly over {name}={tp}")
    src_heads, dst_heads = num_kv_heads // src_tp, num_kv_heads // dst_tp
    plan: list[list[ReshardPiece]] = []
    for src_rank in range(src_tp):
        lo, hi = src_rank * src_heads, (src_rank + 1) * src_heads
        pieces = []
        for dst_rank in range(lo // dst_heads, (hi - 1) // dst_heads + 1):
            start = max(lo, dst_rank * dst_heads)
            end = min(hi, (dst_rank + 1) * dst_heads)
            pieces.append(
                ReshardPiece(dst_rank, (start - lo, end - lo), start - dst_rank * dst_heads)
            )
        plan.append(pieces)
    return plan


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,
    staging_ptr,
    block_ids_ptr,
    head_start,
    stride_pb,
    stride_pl,
    stride_pkv,
    stride_pt,
    stride_ph,
    stride_sb,
    stride_sl,
    stride_skv,
    stride_st,
    stride_sh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TO_POOL: tl.constexpr,
):
    # grid: (block i, layer * 2 + kv, tile of ROWS (token, head) rows)
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1) // 2
    kv = tl.program_id(1) % 2
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    r = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DIM_PAD)
    t = r // NUM_HEADS
    h = r % NUM_HEADS
    mask = (r < BLOCK_SIZE * NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    pool_row = (
        block_id * stride_pb
        + layer * stride_pl
        + kv * stride_pkv
        + t * stride_pt
        + (head_start + h) * stride_ph
    )
    staging_row = (
        i * stride_sb + layer * stride_sl + kv * stride_skv + t * stride_st + h * stride_sh
    )
    pool_offs = pool_row[:, None] + d[None, :]  # (ROWS, D)
    staging_offs = staging_row[:, None] + d[None, :]
    if TO_POOL:
        x = tl.load(staging_ptr + staging_offs, mask=mask)
        tl.store(pool_ptr + pool_offs, x, mask=mask)
    else:
        x = tl.load(pool_ptr + pool_offs, mask=mask)
        tl.store(staging_ptr + staging_offs, x, mask=mask)


def pack_blocks(
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
    head_end: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather heads ``[head_start, head_end)`` of the listed blocks.

    pool: (num_blocks, L, 2, block_size, H, D). Returns (or fills ``out``, which must be
    contiguous) the staging tensor (n, L, 2, block_size, head_end - head_start, D).
    """
    ids = _check_pool_and_ids(pool, block_ids, head_start, head_end)
    _, L, _, block_size, _, D = pool.shape
    shape = (ids.numel(), L, 2, block_size, head_end - head_start, D)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    else:
        _check_staging(out, shape, pool)
    _launch(pool, out, ids, head_start, to_pool=False)
    return out


def scatter_blocks(
    staging: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
) -> None:
    """Write a staging tensor (n, L, 2, block_size, h, D) into the listed blocks of ``pool`` at
    heads ``[head_start, head_start + h)``; the twin of ``pack_blocks``. Block ids must be distinct."""
    if staging.dim() != 6:
        raise ValueError(f"staging must be (n, L, 2, block_size, h, D), got {tuple(staging.shape)}")
    ids = _check_pool_and_ids(pool, block_ids, head_start, head_start + staging.shape[4])
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"scatter_blocks needs distinct block ids, got {ids.tolist()}")
    _, L, _, block_size, _, D = pool.shape
    _check_staging(staging, (ids.numel(), L, 2, block_size, staging.shape[4], D), pool)
    _launch(pool, staging, ids, head_start, to_pool=True)


def pack_blocks_ref(
    pool: torch.Tensor, block_ids: torch.Tensor | Sequence[int], head_start: int, head_end: int
) -> torch.Tensor:
    """Pure-torch reference for ``pack_blocks``."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=pool.device)
    return pool[ids][:, :, :, :, head_start:head_end].contiguous()


def scatter_blocks_ref(
    staging: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
) -> None:
    """Pure-torch reference for ``scatter_blocks``."""
    for i, block_id in enumerate(torch.as_tensor(block_ids).tolist()):
        pool[block_id, :, :, :, head_start : head_start + staging.shape[4]] = staging[i]


def _launch(
    pool: torch.Tensor, staging: torch.Tensor, ids: torch.Tensor, head_start: int, to_pool: bool
) -> None:
    n = ids.numel()
    _, L, _, block_size, _, D = pool.shape
    num_heads = staging.shape[4]
    if n == 0 or num_heads == 0:
        return
    bits = _BITS_DTYPES[pool.element_size()]
    pool_bits, staging_bits = pool.view(bits), staging.view(bits)
    dim_pad = triton.next_power_of_2(D)
    rows = min(triton.next_power_of_2(block_size * num_heads), max(_TILE_ELEMS // dim_pad, 1))
    grid = (n, 2 * L, triton.cdiv(block_size * num_heads, rows))
    _copy_blocks_kernel[grid](
        pool_bits,
        staging_bits,
        ids,
        head_start,
        *pool.stride()[:5],
        *staging.stride()[:5],
        NUM_HEADS=num_heads,
        HEAD_DIM=D,
        BLOCK_SIZE=block_size,
        ROWS=rows,
        DIM_PAD=dim_pad,
        TO_POOL=to_pool,
    )


def _check_pool_and_ids(
    pool: torch.Tensor, block_ids: torch.Tensor | Sequence[int], head_start: int, head_end: int
) -> torch.Tensor:
    """Validate the pool, head range and block ids; returns the ids as a contiguous int64 tensor."""
    if pool.dim() != 6 or pool.shape[2] != 2:
        raise ValueError(
            f"pool must be (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), "
            f"got {tuple(pool.shape)}"
        )
    if pool.element_size() not in _BITS_DTYPES or pool.dtype.is_complex or pool.dtype == torch.bool:
        raise TypeError(f"unsupported pool dtype {pool.dtype}")
    if pool.stride(-1) != 1:
        raise ValueError(f"pool must have unit stride in head_dim, got strides {pool.stride()}")
    num_blocks, num_heads = pool.shape[0], pool.shape[4]
    if not 0 <= head_start < head_end <= num_heads:
        raise ValueError(
            f"head range [{head_start}, {head_end}) is not a non-empty range inside the pool's "
            f"{num_heads} heads"
        )
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"block_ids must be a 1-D int32/int64 tensor, got {block_ids.dtype} "
                f"of shape {tuple(block_ids.shape)}"
            )
        if block_ids.device != pool.device:
            raise ValueError(f"block_ids are on {block_ids.device}, the pool on {pool.device}")
        ids = block_ids.to(torch.int64).contiguous()
    else:
        ids = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.device)
    lo, hi = torch.stack(ids.aminmax()).tolist() if ids.numel() else (0, 0)
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {ids.tolist()}")
    return ids


def _check_staging(staging: torch.Tensor, shape: tuple[int, ...], pool: torch.Tensor) -> None:
    if tuple(staging.shape) != shape:
        raise ValueError(f"staging must have shape {shape}, got {tuple(staging.shape)}")
    if staging.dtype != pool.dtype:
        raise TypeError(f"staging is {staging.dtype} but the pool is {pool.dtype}")
    if staging.device != pool.device:
        raise ValueError(f"staging is on {staging.device}, the pool on {pool.device}")
    if not staging.is_contiguous():
        raise ValueError(f"staging must be contiguous, got strides {staging.stride()}")
