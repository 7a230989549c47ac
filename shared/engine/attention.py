"""Attention over the paged KV cache.

One entry point serves prefill, chunked prefill, decode and speculative scoring: every sequence in
the batch brings ``query_len`` new tokens whose K/V are first written into their slots, then its
queries attend causally over the sequence's whole context read through its block table.
The torch path is the CPU default; on CUDA the Triton kernel in ``kernels.paged_attention`` takes
over for decode-only batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where a forward pass's new tokens go and what each sequence attends to."""

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each new token
    query_lens: list[int]  # per sequence, sums to T
    context_lens: torch.Tensor  # (B,) int64: KV length of each sequence including its new tokens
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    block_size: int
    use_triton: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store new keys/values. k_cache: (num_blocks, block_size, H_kv, D); k: (T, H_kv, D)."""
    blocks = meta.slot_mapping // meta.block_size
    offsets = meta.slot_mapping % meta.block_size
    k_cache[blocks, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, offsets] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: (T, H_q, D); k, v: (T, H_kv, D) for the new tokens. Returns (T, H_q, D)."""
    write_kv(k_cache, v_cache, k, v, meta)
    if meta.use_triton and meta.is_decode_only:
        from kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    if meta.num_seqs == 1 and int(meta.context_lens[0]) == meta.query_lens[0]:
        # A whole prompt in one go: no earlier context, attend over the fresh K/V directly.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
    return _paged_attention_torch(q, k_cache, v_cache, meta, scale)


def _paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    B = meta.num_seqs
    T, H_q, D = q.shape
    bs = meta.block_size
    max_q = max(meta.query_lens)
    max_blocks = meta.block_tables.shape[1]
    S = max_blocks * bs
    # (B, S, H_kv, D) gathered through the block tables
    keys = k_cache[meta.block_tables].flatten(1, 2).to(q.dtype)
    values = v_cache[meta.block_tables].flatten(1, 2).to(q.dtype)
    q_lens = torch.tensor(meta.query_lens, dtype=torch.int64)
    ctx = meta.context_lens.to(torch.int64).cpu()
    # Scatter packed queries into (B, max_q, H_q, D); row i of seq b sits at position ctx-q_len+i.
    q_idx = torch.arange(max_q)
    valid_q = q_idx[None, :] < q_lens[:, None]  # (B, max_q)
    q_pad = q.new_zeros(B, max_q, H_q, D)
    q_pad[valid_q] = q
    q_pos = (ctx - q_lens)[:, None] + q_idx[None, :]  # (B, max_q)
    k_pos = torch.arange(S)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # (B, H_q, max_q, D)
        keys.transpose(1, 2),  # (B, H_kv, S, D)
        values.transpose(1, 2),
        attn_mask=mask.unsqueeze(1).to(q.device),
        scale=scale,
        enable_gqa=True,
    )  # (B, H_q, max_q, D)
    return out.transpose(1, 2)[valid_q.to(q.device)]
