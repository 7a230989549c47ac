"""Paged decode attention: one query token per sequence attends over its KV blocks.

The caches are the strided per-layer views of a KV pool (``KVPool.layer(i)``):
``(num_blocks, block_size, H_kv, D)`` whose block stride spans every layer's K and V, so the kernel
takes all strides as given and never copies the cache. One program handles one sequence and one KV
head together with its whole GQA group of query heads, so each K/V block is loaded once per group.
Softmax is computed online over blocks with fp32 statistics and accumulator.

An fp8 cache (``kv_scales`` given: the layer's (num_blocks, H_kv) float32 K and V scales, see
``shared/kv/kv_quant.py``) is read as bytes and decoded through a 256-entry table of e4m3fn
values (torch's own; a gather from a small table is exact, and runs the same under the
interpreter, which has no fp8 type), times the scale of the (block, KV head).

An int8 cache (``kv_scales``: the layer's (num_blocks, block_size, H_kv, D // 32) float32 K and V
scales, see ``shared/kv/kv_int8.py``) is read as int8 times the scale of each token's group of
32 values.

The pure-torch references (``*_ref``) are in ``paged_attention_ref.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvmesh.shared.kv.kv_int8 import GROUP as INT8_GROUP
from kvmesh.shared.kv.kv_int8 import rotation_matrix
from kvmesh.shared.kv.kv_quant import e4m3_lut

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
# KV_MODE of the kernel: how a cache element becomes a value
_PLAIN, _FP8, _INT8 = 0, 1, 2


@triton.jit
def _load_tile(
    ptr,
    scale_ptr,
    lut_ptr,
    block_id,
    kv_head,
    t,
    d,
    kv_mask,
    stride_b,
    stride_t,
    stride_h,
    stride_sb,
    stride_sh,
    stride_st,
    KV_MODE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
):
    """One block's (T, D) keys or values of ``kv_head``, decoded to float32 as KV_MODE says."""
    x = tl.load(
        ptr + block_id * stride_b + t[:, None] * stride_t + kv_head * stride_h + d[None, :],
        mask=kv_mask,
        other=0,
    )
    if KV_MODE == 1:  # fp8 bytes -> value * the tile's scale
        tile_scale = tl.load(scale_ptr + block_id * stride_sb + kv_head * stride_sh)
        x = tl.load(lut_ptr + x.to(tl.int32)) * tile_scale
    if KV_MODE == 2:  # int8 * the scale of each token's group of SCALE_GROUP values
        scale_at = block_id * stride_sb + kv_head * stride_sh + t[:, None] * stride_st
        scale_at = scale_at + d[None, :] // SCALE_GROUP
        x = x.to(tl.float32) * tl.load(scale_ptr + scale_at, mask=kv_mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _load_rotation(rot_ptr, d, d_mask, HEAD_DIM: tl.constexpr):
    """The (D, D) int8 rotation (kv_int8.rotation_matrix), symmetric."""
    return tl.load(
        rot_ptr + d[:, None] * HEAD_DIM + d[None, :],
        mask=d_mask[:, None] & d_mask[None, :],
        other=0.0,
    )


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    token_seq_ptr,
    prefix_lens_ptr,
    tree_bits_ptr,
    k_scale_ptr,
    v_scale_ptr,
    lut_ptr,
    rot_ptr,
    scale,
    stride_qr,
    stride_qh,
    stride_or,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_btj,
    stride_sb,
    stride_sh,
    stride_st,
    IS_TREE: tl.constexpr,
    KV_MODE: tl.constexpr,
    SCALE_GROUP: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    TOKENS_PAD: tl.constexpr,
):
    # A row is one query token: a sequence's only one when decoding (row == sequence), one of its
    # new tokens when verifying a tree (IS_TREE; the tree pointers are unused otherwise).
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TOKENS_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q_heads = kv_head * GROUP + g
    q_mask = g_mask[:, None] & d_mask[None, :]

    # (G, D) queries of this KV head's group, pre-scaled
    q = tl.load(
        q_ptr + row * stride_qr + q_heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    q = q.to(tl.float32) * scale
    if KV_MODE == 2:  # int8 K/V are stored rotated (kv_int8.rotate): rotate q alike, once
        rot = _load_rotation(rot_ptr, d, d_mask, HEAD_DIM)
        q = tl.sum(q[:, :, None] * rot[None, :, :], axis=1)  # (G, D)

    if IS_TREE:
        seq = tl.load(token_seq_ptr + row).to(tl.int64)
        prefix = tl.load(prefix_lens_ptr + seq).to(tl.int32)  # keys every new token sees
        bits = tl.load(tree_bits_ptr + row)  # int64: which new tokens this one sees
    else:
        seq = row
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for j in range(0, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_btb + j * stride_btj).to(tl.int64)
        key = j * BLOCK_SIZE + t
        t_mask = (t < BLOCK_SIZE) & (key < context_len)
        if IS_TREE:
            shift = tl.maximum(key - prefix, 0).to(tl.int64)
            t_mask = t_mask & ((key < prefix) | (((bits >> shift) & 1) == 1))
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = _load_tile(
            k_ptr, k_scale_ptr, lut_ptr, block_id, kv_head, t, d, kv_mask,
            stride_kb, stride_kt, stride_kh, stride_sb, stride_sh, stride_st,
            KV_MODE, SCALE_GROUP,
        )  # fmt: skip
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # (G, T)
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if IS_TREE:
            # a block may hide every key (a node's block of siblings): keep the max finite
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            # every visited block holds >= 1 valid token, so m_new is finite
            m_safe = m_new
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])  # (G, T)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_tile(
            v_ptr, v_scale_ptr, lut_ptr, block_id, kv_head, t, d, kv_mask,
            stride_vb, stride_vt, stride_vh, stride_sb, stride_sh, stride_st,
            KV_MODE, SCALE_GROUP,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    out = acc / l_i[:, None]
    if KV_MODE == 2:  # the weighted sum of rotated V, rotated back
        rot = _load_rotation(rot_ptr, d, d_mask, HEAD_DIM)
        out = tl.sum(out[:, :, None] * rot[None, :, :], axis=1)
    tl.store(
        out_ptr + row * stride_or + q_heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def _launch(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Run the kernel over q's rows and every KV head; ``tree`` is (token_seq, prefix_lens,
    tree_bits) when the rows are draft-tree tokens, None when each row is one decoding sequence;
    ``kv_scales`` the K and V scales of an fp8 or int8 cache."""
    _, block_size, H_kv, _ = k_cache.shape
    R, H_q, D = q.shape
    group = H_q // H_kv
    context_lens = context_lens.contiguous()
    token_seq, prefix_lens, tree_bits = tree if tree is not None else (context_lens,) * 3
    if kv_scales is None:
        k_scales = v_scales = lut = rot = context_lens  # unused
        scale_strides = (0, 0, 0)
        mode = _PLAIN
    elif k_cache.dtype == torch.int8:
        k_scales, v_scales = kv_scales
        lut = context_lens  # unused
        rot = rotation_matrix(k_cache.shape[3], q.device)
        block_stride, slot_stride, head_stride, _ = k_scales.stride()
        scale_strides = (block_stride, head_stride, slot_stride)
        mode = _INT8
    else:
        k_scales, v_scales = kv_scales
        lut = e4m3_lut(q.device)
        rot = context_lens  # unused
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        scale_strides = (*k_scales.stride(), 0)
        mode = _FP8
    _paged_attention_kernel[(R, H_kv)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        token_seq,
        prefix_lens,
        tree_bits,
        k_scales,
        v_scales,
        lut,
        rot,
        float(scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        *scale_strides,
        IS_TREE=tree is not None,
        KV_MODE=mode,
        SCALE_GROUP=INT8_GROUP,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_SIZE=block_size,
        GROUP_PAD=max(triton.next_power_of_2(group), 2),
        DIM_PAD=max(triton.next_power_of_2(D), 2),
        TOKENS_PAD=max(triton.next_power_of_2(block_size), 2),
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Decode attention through block tables.

    q: (B, H_q, D); k_cache, v_cache: (num_blocks, block_size, H_kv, D), any strides with the last
    one 1; block_tables: (B, max_blocks) int32/int64; context_lens: (B,) int32/int64, each in
    [1, max_blocks * block_size]; kv_scales: the float32 K and V scales of an fp8 cache
    (num_blocks, H_kv) or of an int8 cache (num_blocks, block_size, H_kv, D // 32), as
    ``KVPool.layer_scales`` gives them; None otherwise. Returns (B, H_q, D) in q's dtype.
    """
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens, kv_scales)
    B, H_q, D = q.shape
    out = torch.empty((B, H_q, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    _launch(out, q, k_cache, v_cache, block_tables, context_lens, scale, kv_scales=kv_scales)
    return out


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H_q, D), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be (num_blocks, block_size, H_kv, D), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    B, H_q, D = q.shape
    num_blocks, block_size, H_kv, D_kv = k_cache.shape
    if D_kv != D:
        raise ValueError(f"head_dim of q ({D}) and of the cache ({D_kv}) differ")
    if H_q % H_kv != 0:
        raise ValueError(f"query heads ({H_q}) must be a multiple of KV heads ({H_kv})")
    cache_dtypes = SUPPORTED_DTYPES if kv_scales is None else (torch.float8_e4m3fn, torch.int8)
    if q.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in cache_dtypes:
        raise TypeError(
            f"q must be one of {SUPPORTED_DTYPES} and the cache one of {cache_dtypes} (fp8 and "
            f"int8 with kv_scales), got {q.dtype} and {k_cache.dtype}"
        )
    if kv_scales is not None:
        k_scales, v_scales = kv_scales
        want: tuple[int, ...] = (num_blocks, H_kv)
        if k_cache.dtype == torch.int8:
            want = (num_blocks, block_size, H_kv, D // INT8_GROUP)
            if D % INT8_GROUP:
                raise ValueError(
                    f"an int8 cache needs head_dim a multiple of {INT8_GROUP}, got {D}"
                )
        if k_scales.shape != want or v_scales.shape != want:
            raise ValueError(
                f"kv_scales must be {want} each, got {tuple(k_scales.shape)} "
                f"and {tuple(v_scales.shape)}"
            )
        if k_cache.dtype == torch.int8 and k_scales.stride(-1) != 1:
            raise ValueError(
                f"int8 kv_scales need unit stride in their last dim: {k_scales.stride()}"
            )
        if k_scales.dtype != torch.float32 or v_scales.dtype != torch.float32:
            raise TypeError(f"kv_scales must be float32, got {k_scales.dtype}, {v_scales.dtype}")
        if k_scales.stride() != v_scales.stride():
            raise ValueError(
                f"K and V scales must share strides, got {k_scales.stride()} and {v_scales.stride()}"
            )
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in head_dim, got strides {t.stride()}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B:
        raise ValueError(f"block_tables must be ({B}, max_blocks), got {tuple(block_tables.shape)}")
    if context_lens.shape != (B,):
        raise ValueError(f"context_lens must be ({B},), got {tuple(context_lens.shape)}")
    if block_tables.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise TypeError(
            f"block_tables and context_lens must be int32/int64, got {block_tables.dtype} "
            f"and {context_lens.dtype}"
        )
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    devices |= {t.device for t in kv_scales or ()}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(map(str, devices))}")
    if B == 0:
        return
    # One host sync for all value checks: this runs once per layer per decode step.
    max_len = block_tables.shape[1] * block_size
    lens_lo, lens_hi = context_lens.long().aminmax()
    # Only the entries a sequence actually reads must name real blocks; padding is never loaded.
    used_blocks = (context_lens.clamp(0, max_len) + block_size - 1) // block_size  # (B,)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = cols[None, :] < used_blocks[:, None]  # (B, max_blocks)
    ids_lo, ids_hi = torch.where(used, block_tables.long(), 0).aminmax()
    lens_lo, lens_hi, ids_lo, ids_hi = torch.stack([lens_lo, lens_hi, ids_lo, ids_hi]).tolist()
    if lens_lo < 1 or lens_hi > max_len:
        raise ValueError(
            f"context_lens must lie in [1, {max_len}] (max_blocks * block_size), "
            f"got {context_lens.tolist()}"
        )
    if ids_lo < 0 or ids_hi >= num_blocks:
        raise ValueError(
            f"block_tables name blocks outside [0, {num_blocks}): min {ids_lo}, max {ids_hi}"
        )


# ---- draft-tree verification ----------------------------------------------------------------
# Several new tokens per sequence (its last token, then a draft tree's nodes) attend to the
# sequence's earlier context and, among the new tokens, to those their row's bitmask names (bit a:
# new token a), so a node sees its ancestors and itself. Rows of plain decodes carry bit 0.

MAX_TREE_QUERIES = 64


def paged_tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: list[int],
    tree_bits: torch.Tensor,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of several new tokens per sequence through block tables, masked by tree bits.

    q: (T, H_q, D), T = sum(query_lens), each sequence's new tokens the last ``query_lens[b]``
    (<= 64) of its ``context_lens[b]``; tree_bits: (T,) int64, bit a of a row set when it sees
    its sequence's new token a (it always sees the earlier context). Caches and tables as
    ``paged_decode_attention``. Returns (T, H_q, D) in q's dtype.
    """
    B = len(query_lens)
    T = sum(query_lens)
    if q.dim() != 3 or q.shape[0] != T:
        raise ValueError(
            f"q must be ({T}, H_q, D) for query_lens {query_lens}, got {tuple(q.shape)}"
        )
    if any(not 1 <= n <= MAX_TREE_QUERIES for n in query_lens):
        raise ValueError(f"query_lens must lie in [1, {MAX_TREE_QUERIES}], got {query_lens}")
    if tree_bits.shape != (T,) or tree_bits.dtype != torch.int64:
        raise ValueError(
            f"tree_bits must be ({T},) int64, got {tuple(tree_bits.shape)} {tree_bits.dtype}"
        )
    if tree_bits.device != q.device:
        raise ValueError(f"tree_bits is on {tree_bits.device}, q on {q.device}")
    _check_inputs(q[:B], k_cache, v_cache, block_tables, context_lens, kv_scales)
    H_q, D = q.shape[1], q.shape[2]
    out = torch.empty((T, H_q, D), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    lens = torch.tensor(query_lens, dtype=torch.int64, device=q.device)
    token_seq = torch.repeat_interleave(torch.arange(B, device=q.device), lens)
    prefix_lens = (context_lens.long() - lens).contiguous()
    if bool((prefix_lens < 0).any()):
        raise ValueError(
            f"context_lens {context_lens.tolist()} shorter than query_lens {query_lens}"
        )
    _launch(
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        tree=(token_seq, prefix_lens, tree_bits.contiguous()),
        kv_scales=kv_scales,
    )
    return out
