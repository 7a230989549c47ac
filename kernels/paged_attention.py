"""Paged attention through block tables, checked: decode (one query token per sequence,
``paged_decode_attention``) and draft-tree verification (several new tokens per sequence masked
by tree bits, ``paged_tree_attention``). Every input's shape, dtype, stride and device is checked
here, and the block ids and context lengths with one host sync; the Triton program is in
``paged_attention_kernel.py``, the pure-torch references (``*_ref``) in
``paged_attention_ref.py``.
"""

from __future__ import annotations

import torch
from kvmesh.kernels.paged_attention_kernel import launch
from kvmesh.shared.kv.kv_int8 import GROUP as INT8_GROUP

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


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
    launch(out, q, scale, k_cache, v_cache, block_tables, context_lens, kv_scales=kv_scales)
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
    launch(
        out,
        q,
        scale,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        tree=(token_seq, prefix_lens, tree_bits.contiguous()),
        kv_scales=kv_scales,
    )
    return out
