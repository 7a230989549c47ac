"""The paged attention Triton program and its launch: query rows attend over their sequences'
KV blocks (``paged_attention.py`` holds the checked entry points, ``paged_attention_ref.py`` the
torch references).

The caches are the strided per-layer views of a KV pool (``KVPool.layer(i)``):
``(num_blocks, block_size, H_kv, D)`` whose block stride spans every layer's K and V, so the kernel
takes all strides as given and never copies the cache. One program handles one query row and one
KV head together with its whole GQA group of query heads, so each K/V block is loaded once per
group. Softmax is computed online over blocks with fp32 statistics and accumulator. A row is a
decoding sequence's one token, or one of a draft tree's tokens masked by its tree bits.

An fp8 cache (``kv_scales`` given: the layer's (num_blocks, H_kv) float32 K and V scales, see
``shared/kv/kv_quant.py``) is read as bytes and decoded through a 256-entry table of e4m3fn
values (torch's own; a gather from a small table is exact, and runs the same under the
interpreter, which has no fp8 type), times the scale of the (block, KV head).

An int8 cache (``kv_scales``: the layer's (num_blocks, block_size, H_kv, D // 32) float32 K and V
scales, see ``shared/kv/kv_int8.py``) is read as int8 times the scale of each token's group of
32 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvmesh.shared.kv.kv_int8 import GROUP as INT8_GROUP
from kvmesh.shared.kv.kv_int8 import rotation_matrix
from kvmesh.shared.kv.kv_quant import e4m3_lut

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


def launch(
    out: torch.Tensor,
    q: torch.Tensor,
    scale: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
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
