"""KV dtype conversion on the send side (``pack_converted``, torch): when the two sides keep KV
in different dtypes (float32, bf16, fp16, fp8 e4m3 or int8 with scales; ``--kv-cache-dtype``),
the source blocks are read as float32 (fp8 and int8 times their scales) and written into staging
in the destination's head-span layout: its dtype, then its scales after the data: for fp8 a
power-of-two scale per (block, head, layer, K/V), the scale rule of ``shared/kv/kv_quant.py``
over the tokens the block holds; for int8 a scale per 32 values of each token
(``shared/kv/kv_int8.py``). Same-dtype moves are ``kv_pack.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from kvmesh.kernels.kv_pack import check_pool_and_ids

_FP8 = torch.float8_e4m3fn
_INT8 = torch.int8


def converted_head_bytes(
    num_layers: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one head span of a block in ``dtype`` (fp8: data, then a float32 scale per
    (layer, K/V); int8: data, then a float32 scale per (layer, K/V, token, 32 values));
    ``KVCacheSpec.head_bytes`` for that layout."""
    from kvmesh.shared.kv.kv_cache import KVCacheSpec

    return KVCacheSpec(num_layers, 1, head_dim, block_size, dtype).head_bytes


def pack_converted(
    pool: torch.Tensor,
    scales: torch.Tensor | None,
    block_ids: torch.Tensor | Sequence[int],
    head_start: int,
    head_end: int,
    dst_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    num_tokens: int | None = None,
) -> torch.Tensor:
    """Heads ``[head_start, head_end)`` of the listed blocks converted to ``dst_dtype``, as the
    head spans of destination blocks of the same block size: (n, h * head_bytes) uint8 (or into
    ``out``, contiguous, of that shape).

    pool: (num_blocks, H, L, 2, bs, D), any strides with the last one 1; scales: the pool's
    float32 scales (``KVPool.scales``) when it is fp8 (num_blocks, H, L, 2) or int8 (num_blocks,
    H, L, 2, bs, D // 32), else None. ``num_tokens``: how many tokens of the run the blocks hold
    (the rest of a last block is written as zeros and does not count towards its scale); default
    all.
    """
    ids = check_pool_and_ids(pool, block_ids, head_start, head_end)
    if (scales is not None) != (pool.dtype in (_FP8, _INT8)):
        raise TypeError(f"a {pool.dtype} pool needs scales exactly when it is fp8 or int8")
    n, h = ids.numel(), head_end - head_start
    _, _, L, _, bs, D = pool.shape
    head_bytes = converted_head_bytes(L, bs, D, dst_dtype)
    if out is None:
        out = torch.empty((n, h * head_bytes), dtype=torch.uint8, device=pool.device)
    elif out.shape != (n, h * head_bytes) or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous ({n}, {h * head_bytes}) uint8 tensor, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    spans = out.view(n, h, head_bytes)
    past_run = None  # (n, 1, 1, 1, bs, 1): the slots past the run's num_tokens
    if num_tokens is not None and num_tokens < n * bs:
        token = torch.arange(n * bs, device=pool.device).view(n, 1, 1, 1, bs, 1)
        past_run = token >= num_tokens
    if pool.dtype == _INT8 and dst_dtype == _INT8:  # the bytes and scales as they are
        data = pool[ids][:, head_start:head_end]
        token_scales = scales[ids][:, head_start:head_end]
        if past_run is not None:
            data, token_scales = (
                data.masked_fill(past_run, 0),
                token_scales.masked_fill(past_run, 0),
            )
        _write_int8(spans, data, token_scales)
        return out
    if pool.dtype == _INT8:
        from kvmesh.shared.kv.kv_int8 import dequantize

        values = dequantize(pool[ids][:, head_start:head_end], scales[ids][:, head_start:head_end])
    else:
        values = pool[ids][:, head_start:head_end].float()  # (n, h, L, 2, bs, D)
    if scales is not None and pool.dtype == _FP8:
        values *= scales[ids][:, head_start:head_end, :, :, None, None]
    if past_run is not None:
        values.masked_fill_(past_run, 0.0)
    if dst_dtype == _FP8:
        from kvmesh.shared.kv.kv_quant import pow2_scale, quantize

        tile_scales = pow2_scale(values.abs().amax((-2, -1)))  # (n, h, L, 2)
        data = quantize(values / tile_scales[..., None, None])
        num_data = head_bytes - 2 * L * 4
        spans[:, :, :num_data] = data.view(torch.uint8).reshape(n, h, num_data)
        spans[:, :, num_data:] = tile_scales.contiguous().view(torch.uint8).reshape(n, h, -1)
    elif dst_dtype == _INT8:
        from kvmesh.shared.kv.kv_int8 import quantize as quantize_int8

        _write_int8(spans, *quantize_int8(values))
    else:
        spans.copy_(values.to(dst_dtype).contiguous().view(torch.uint8).reshape(n, h, head_bytes))
    return out


def _write_int8(spans: torch.Tensor, data: torch.Tensor, scales: torch.Tensor) -> None:
    """int8 ``data`` (n, h, L, 2, bs, D) then its ``scales`` (..., D // 32) into head spans
    (n, h, head_bytes) uint8."""
    n, h = spans.shape[:2]
    num_data = data[0, 0].numel()
    spans[:, :, :num_data] = data.contiguous().view(torch.uint8).reshape(n, h, num_data)
    spans[:, :, num_data:] = scales.contiguous().view(torch.uint8).reshape(n, h, -1)
