"""KV data plane pack/scatter: move a head range of whole blocks between a pool and a staging buffer.

A pool is ``(num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim)`` (head-major blocks,
see docs/ARCHITECTURE.md), so a head range of one block is already one contiguous span and plain
tensor-parallel resharding needs no copy (``services/prefill/kv_writes.py`` writes straight from
the pool). The pack kernel is for the layouts that really differ: it gathers heads
``[head_start, head_end)`` of the listed blocks into a contiguous staging tensor
``(m, num_heads, num_layers, 2, staging_block_size, head_dim)``, optionally regrouping the tokens
into blocks of another size (source block 16 -> destination block 32 or 8); ``scatter_blocks`` is
its twin on the receiving side. ``reshard_plan`` says which head pieces go where. The kernels copy
raw bits (elements viewed as same-width integers), so one kernel serves fp32, bf16, fp16 and fp8.

Dtype conversion (the two sides keep KV in different dtypes) is ``kv_convert.py``'s.

Token regroup: the listed blocks are read as one run of ``n * block_size`` tokens; staging block
``j`` holds tokens ``[j * B, (j + 1) * B)`` of that run. Pack zero-fills the tail of a last staging
block the run does not fill (nothing uninitialised goes on the wire); scatter writes only the
tokens the staging holds and leaves the rest of a partly covered last pool block as it was.
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
    ``dst_tp``. Rank r of a TP degree t holds heads ``[r * H / t, (r + 1) * H / t)``: even
    splits only, the kernels' tests' and benchmarks' reference. The product plans with
    ``shared/kv/head_shards.py`` (``reshard_pieces``: uneven splits and replicas too); the pack
    and scatter kernels take any head range, so a piece of an uneven split packs as any other."""
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
def _copy_tokens_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_head0,
    dst_head0,
    num_tokens,
    stride_sb,
    stride_sh,
    stride_sl,
    stride_skv,
    stride_st,
    stride_db,
    stride_dh,
    stride_dl,
    stride_dkv,
    stride_dt,
    NUM_LAYERS: tl.constexpr,
    NUM_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SRC_BS: tl.constexpr,
    DST_BS: tl.constexpr,
    ROWS: tl.constexpr,
    ELEMS: tl.constexpr,
    ZERO_FILL: tl.constexpr,
):
    # Copies token g of the run (src block src_ids[g // SRC_BS], slot g % SRC_BS) to destination
    # block dst_ids[g // DST_BS], slot g % DST_BS, for every (head, layer, kv) row.
    # grid: (destination block j, tile of ROWS (head, layer, kv) rows, tile of ELEMS (token, d))
    j = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    e = tl.program_id(2) * ELEMS + tl.arange(0, ELEMS)  # (ELEMS,)
    head = (q // (2 * NUM_LAYERS)).to(tl.int64)
    layer = (q // 2) % NUM_LAYERS
    kv = q % 2
    t = e // HEAD_DIM
    d = e % HEAD_DIM
    g = j * DST_BS + t  # token index in the run, int64
    in_block = e < DST_BS * HEAD_DIM
    has_src = in_block & (g < num_tokens)
    src_block = tl.load(src_ids_ptr + g // SRC_BS, mask=has_src, other=0).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + j).to(tl.int64)
    src_row = (src_head0 + head) * stride_sh + layer * stride_sl + kv * stride_skv
    dst_row = (dst_head0 + head) * stride_dh + layer * stride_dl + kv * stride_dkv
    src_col = src_block * stride_sb + (g % SRC_BS) * stride_st + d
    dst_col = dst_block * stride_db + t * stride_dt + d
    rows_ok = (q < NUM_ROWS)[:, None]
    x = tl.load(
        src_ptr + src_row[:, None] + src_col[None, :], mask=rows_ok & has_src[None, :], other=0
    )  # (ROWS, ELEMS)
    if ZERO_FILL:
        store_mask = rows_ok & in_block[None, :]
    else:
        store_mask = rows_ok & has_src[None, :]
    tl.store(dst_ptr + dst_row[:, None] + dst_col[None, :], x, mask=store_mask)


def staging_shape(
    pool: torch.Tensor, num_blocks: int, num_heads: int, block_size: int | None = None
) -> tuple[int, int, int, int, int, int]:
    """Shape of the staging tensor ``pack_blocks`` makes from ``num_blocks`` blocks of ``pool``:
    ``(m, num_heads, L, 2, block_size, D)``, ``m = ceil(num_blocks * pool_block_size / block_size)``."""
    _, _, L, _, pool_bs, D = pool.shape
    bs = pool_bs if block_size is None else block_size
    if bs <= 0:
        raise ValueError(f"staging block_size must be positive, got {bs}")
    return (triton.cdiv(num_blocks * pool_bs, bs), num_heads, L, 2, bs, D)


def pack_blocks(
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
    head_end: int,
    out: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Gather heads ``[head_start, head_end)`` of the listed blocks, regrouped into staging blocks
    of ``block_size`` tokens (default: the pool's).

    pool: (num_blocks, H, L, 2, pool_block_size, D). Returns (or fills ``out``, which must be
    contiguous) the staging tensor of ``staging_shape(pool, n, head_end - head_start, block_size)``.
    """
    ids = check_pool_and_ids(pool, block_ids, head_start, head_end)
    shape = staging_shape(pool, ids.numel(), head_end - head_start, block_size)
    if out is None:
        out = torch.empty(shape, dtype=pool.dtype, device=pool.device)
    else:
        _check_staging(out, shape, pool)
    staging_ids = torch.arange(shape[0], dtype=torch.int64, device=pool.device)
    _launch(pool, ids, head_start, out, staging_ids, 0, ids.numel() * pool.shape[4], True)
    return out


def scatter_blocks(
    staging: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
) -> None:
    """Write a staging tensor (m, h, L, 2, staging_block_size, D) into the listed blocks of
    ``pool`` at heads ``[head_start, head_start + h)``; the twin of ``pack_blocks``. The staging
    tokens fill ``ceil(m * staging_block_size / pool_block_size)`` blocks, which must be the
    number of (distinct) block ids given."""
    if staging.dim() != 6 or staging.shape[3] != 2:
        raise ValueError(
            f"staging must be (m, num_heads, num_layers, 2, block_size, head_dim), "
            f"got {tuple(staging.shape)}"
        )
    ids = check_pool_and_ids(pool, block_ids, head_start, head_start + staging.shape[1])
    if ids.numel() > 1 and torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"scatter_blocks needs distinct block ids, got {ids.tolist()}")
    m, h, _, _, staging_bs, _ = staging.shape
    pool_bs = pool.shape[4]
    num_tokens = m * staging_bs
    if staging_bs <= 0 or triton.cdiv(num_tokens, pool_bs) != ids.numel():
        raise ValueError(
            f"staging holds {m} blocks of {staging_bs} tokens, which fill "
            f"{triton.cdiv(num_tokens, pool_bs) if staging_bs > 0 else 0} pool blocks of "
            f"{pool_bs}, but {ids.numel()} block ids were given"
        )
    _check_staging(staging, (m, h, *pool.shape[2:4], staging_bs, pool.shape[5]), pool)
    staging_ids = torch.arange(m, dtype=torch.int64, device=pool.device)
    _launch(staging, staging_ids, 0, pool, ids, head_start, num_tokens, False)


def pack_blocks_ref(
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
    head_end: int,
    block_size: int | None = None,
) -> torch.Tensor:
    """Pure-torch reference for ``pack_blocks``."""
    ids = torch.as_tensor(block_ids, dtype=torch.int64, device=pool.device)
    m, h, L, _, bs, D = staging_shape(pool, ids.numel(), head_end - head_start, block_size)
    run = pool[ids][:, head_start:head_end]  # (n, h, L, 2, pool_bs, D)
    run = run.permute(1, 2, 3, 0, 4, 5).reshape(h, L, 2, -1, D)  # (h, L, 2, n * pool_bs, D)
    out = torch.zeros((h, L, 2, m * bs, D), dtype=pool.dtype, device=pool.device)
    out[:, :, :, : run.shape[3]] = run
    return out.view(h, L, 2, m, bs, D).permute(3, 0, 1, 2, 4, 5).contiguous()


def scatter_blocks_ref(
    staging: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
) -> None:
    """Pure-torch reference for ``scatter_blocks``."""
    m, h, L, _, staging_bs, D = staging.shape
    pool_bs = pool.shape[4]
    run = staging.permute(1, 2, 3, 0, 4, 5).reshape(h, L, 2, m * staging_bs, D)
    for i, block_id in enumerate(torch.as_tensor(block_ids).tolist()):
        tokens = run[:, :, :, i * pool_bs : (i + 1) * pool_bs]
        pool[block_id, head_start : head_start + h, :, :, : tokens.shape[3]] = tokens


def _launch(
    src: torch.Tensor,
    src_ids: torch.Tensor,
    src_head0: int,
    dst: torch.Tensor,
    dst_ids: torch.Tensor,
    dst_head0: int,
    num_tokens: int,
    zero_fill: bool,
) -> None:
    """Copy ``num_tokens`` tokens of heads ``[src_head0, +h)`` of ``src`` (blocks ``src_ids``) to
    heads ``[dst_head0, +h)`` of ``dst`` (blocks ``dst_ids``); both (blocks, H, L, 2, bs, D)."""
    h = min(src.shape[1] - src_head0, dst.shape[1] - dst_head0)
    _, _, L, _, src_bs, D = src.shape
    dst_bs = dst.shape[4]
    if dst_ids.numel() == 0 or num_tokens == 0:
        return
    bits = _BITS_DTYPES[src.element_size()]
    num_rows = h * L * 2
    elems = min(triton.next_power_of_2(dst_bs * D), _TILE_ELEMS)
    rows = min(triton.next_power_of_2(num_rows), max(_TILE_ELEMS // elems, 1))
    grid = (dst_ids.numel(), triton.cdiv(num_rows, rows), triton.cdiv(dst_bs * D, elems))
    _copy_tokens_kernel[grid](
        src.view(bits),
        dst.view(bits),
        src_ids,
        dst_ids,
        src_head0,
        dst_head0,
        num_tokens,
        src.stride(0),
        src.stride(1),
        src.stride(2),
        src.stride(3),
        src.stride(4),
        dst.stride(0),
        dst.stride(1),
        dst.stride(2),
        dst.stride(3),
        dst.stride(4),
        NUM_LAYERS=L,
        NUM_ROWS=num_rows,
        HEAD_DIM=D,
        SRC_BS=src_bs,
        DST_BS=dst_bs,
        ROWS=rows,
        ELEMS=elems,
        ZERO_FILL=zero_fill,
    )


def check_pool_and_ids(
    pool: torch.Tensor, block_ids: torch.Tensor | Sequence[int], head_start: int, head_end: int
) -> torch.Tensor:
    """Validate the pool, head range and block ids; returns the ids as a contiguous int64 tensor."""
    if pool.dim() != 6 or pool.shape[3] != 2:
        raise ValueError(
            f"pool must be (num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim), "
            f"got {tuple(pool.shape)}"
        )
    if pool.element_size() not in _BITS_DTYPES or pool.dtype.is_complex or pool.dtype == torch.bool:
        raise TypeError(f"unsupported pool dtype {pool.dtype}")
    if pool.stride(-1) != 1:
        raise ValueError(f"pool must have unit stride in head_dim, got strides {pool.stride()}")
    num_blocks, num_heads = pool.shape[0], pool.shape[1]
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
