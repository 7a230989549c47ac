"""Pure-torch references of the paged attention kernels (``paged_attention.py``), the
definitions the tests hold the Triton kernels to: each sequence's tokens gathered from its
blocks (an fp8 or int8 cache dequantized), then plain softmax attention in fp32, masked by the
tree bits (a decode is a tree of one token that sees itself). No Triton needed.
"""

from __future__ import annotations

import torch
from kvmesh.shared.kv.kv_int8 import dequantize as dequantize_int8


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pure-torch reference of ``paged_decode_attention``: each sequence's one new token, which
    sees its whole context (``paged_tree_attention_ref`` with one query a sequence)."""
    B = q.shape[0]
    bits = torch.ones(B, dtype=torch.int64, device=q.device)
    return paged_tree_attention_ref(
        q, k_cache, v_cache, block_tables, context_lens, [1] * B, bits, scale, kv_scales
    )


def _read(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    which: int,
) -> torch.Tensor:
    """(len(blocks) * block_size, H_kv, D) float32 tokens of the listed blocks (dequantized)."""
    if kv_scales is not None and cache.dtype == torch.int8:
        return dequantize_int8(cache[blocks], kv_scales[which][blocks]).flatten(0, 1)
    tokens = cache[blocks].float()  # (n, block_size, H_kv, D)
    if kv_scales is not None:
        tokens = tokens * kv_scales[which][blocks][:, None, :, None]
    return tokens.flatten(0, 1)


def paged_tree_attention_ref(
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
    """Pure-torch reference of ``paged_tree_attention``: gather, mask, softmax in fp32."""
    H_q = q.shape[1]
    block_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    out = torch.empty_like(q)
    start = 0
    for b, n_q in enumerate(query_lens):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        keys = _read(k_cache, blocks, kv_scales, 0)[:n].repeat_interleave(group, dim=1)
        values = _read(v_cache, blocks, kv_scales, 1)[:n].repeat_interleave(group, dim=1)
        for r in range(n_q):
            bits = int(tree_bits[start + r])
            seen = [j < n - n_q or (bits >> (j - n + n_q)) & 1 == 1 for j in range(n)]
            visible = torch.tensor(seen, device=q.device)
            scores = torch.einsum("hd,nhd->hn", q[start + r].float(), keys) * scale  # (H_q, n)
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            out[start + r] = torch.einsum("hn,nhd->hd", probs, values).to(q.dtype)
        start += n_q
    return out
