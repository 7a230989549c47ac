"""Attention over the paged KV cache.

One entry point serves prefill, chunked prefill, decode and speculative scoring: every sequence in
the batch brings ``query_len`` new tokens whose K/V are first written into their slots, then its
queries attend causally over the sequence's whole context read through its block table.
A sequence verifying a draft tree (``AttentionMetadata.tree_masks``) instead has its new tokens
attend to its earlier context and, among themselves, only to what the tree mask allows (a node to
its ancestors and itself).
The torch path is the CPU default; on CUDA the Triton kernels in ``kvmesh.kernels.paged_attention``
take over for decode-only batches and for batches verifying draft trees (up to 64 new tokens each).

An fp8 pool (``kv_scales`` given: the layer's (num_blocks, H_kv) K and V scales) stores through
``kv_quant.store`` and every path reads back ``fp8 * scale``; a whole fresh prompt then attends over
its stored (quantized) K/V too, so that no output depends on how a prompt was cut into chunks.
An int8 pool likewise, through ``kv_int8`` (its scales: (num_blocks, block_size, H_kv, D // 32)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from kvmesh.shared.kv import kv_int8, kv_quant

if TYPE_CHECKING:
    from kvmesh.kernels.cpu_ops import DecodePlan


@dataclass(frozen=True, slots=True)
class TreeRows:
    """Draft-tree nodes as one-query rows of a decode batch (the C decode kernels' form of a
    tree, ``model_runner``): row ``b`` attends over its sequence up to the last token and then
    over the node's ancestors and itself, whose K/V sit in the slots after the last token in
    node order. So its context positions from ``starts[b]`` on are read from the slots of
    positions ``positions[offsets[b] + p - starts[b]]``, and its own new K/V goes to the slot of
    its last context position; ``starts[b]`` is the row's context length for a plain row. All
    (rows,) or (n,) int64 on the CPU."""

    starts: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor

    def max_tail(self) -> int:
        """The most context positions any row reads through ``positions``."""
        ends = torch.cat([self.offsets[1:], self.offsets.new_tensor([len(self.positions)])])
        return int((ends - self.offsets).max()) if len(self.offsets) else 0


@dataclass(slots=True)
class AttentionMetadata:
    """Where a forward pass's new tokens go and what each sequence attends to."""

    slot_mapping: torch.Tensor  # (T,) int64: block_id * block_size + offset of each new token
    query_lens: list[int]  # per sequence, sums to T
    context_lens: torch.Tensor  # (B,) int64: KV length of each sequence including its new tokens
    block_tables: torch.Tensor  # (B, max_blocks) int64, padded with 0
    block_size: int
    use_triton: bool = False
    # Sequence index -> (query_len, query_len) bool: which of its new tokens each new token sees
    # (draft-tree verification); sequences not named attend causally.
    tree_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    # Draft-tree nodes as one-query rows (only the C decode kernels read them; see TreeRows).
    tree_rows: TreeRows | None = None
    # The C decode kernels' split of the batch over threads, shared by every layer: made by the
    # engine's backend before the pass (``CpuBackend.plan_step``); None: no C decode this step.
    cpu_plan: DecodePlan | None = None
    # Derived once per forward on first use and shared by every layer.
    _plan: _TorchPlan | None = field(default=None, repr=False)
    _kv_index: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _decode_only: bool | None = field(default=None, repr=False)
    _tree_bits: torch.Tensor | None = field(default=None, repr=False)
    _parts: list[tuple[torch.Tensor | slice, AttentionMetadata]] | None = field(
        default=None, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        if self._decode_only is None:
            self._decode_only = all(q == 1 for q in self.query_lens)
        return self._decode_only

    def torch_plan(self, fresh_ok: bool = True) -> _TorchPlan:
        """The torch path's plan; ``fresh_ok=False``: never the fresh-prompt shortcut (an fp8
        cache reads even a fresh prompt's K/V back from its blocks)."""
        if self._plan is None or (self._plan.fresh_prompt and not fresh_ok):
            self._plan = _TorchPlan.build(self, fresh_ok)
        return self._plan

    def parts(self) -> list[tuple[torch.Tensor | slice, AttentionMetadata]]:
        """A batch whose sequences bring different numbers of queries (decodes beside a prefill
        chunk), split so that nothing is padded: (token rows, metadata) of all the one-query
        sequences together, then of each longer sequence alone. Padding every sequence to the
        longest chunk would cost (sequences x chunk x context) instead of (chunk x context)."""
        if self._parts is None:
            starts = [0]
            for q in self.query_lens:
                starts.append(starts[-1] + q)
            parts: list[tuple[torch.Tensor | slice, AttentionMetadata]] = []
            singles = [i for i, q in enumerate(self.query_lens) if q == 1]
            if singles:
                rows = torch.tensor([starts[i] for i in singles], device=self.slot_mapping.device)
                parts.append((rows, self._subset(singles)))
            for i, q in enumerate(self.query_lens):
                if q > 1:
                    parts.append((slice(starts[i], starts[i] + q), self._subset([i])))
            self._parts = parts
        return self._parts

    def _subset(self, seqs: list[int]) -> AttentionMetadata:
        index = torch.tensor(seqs, device=self.block_tables.device)
        trees = {j: self.tree_masks[i] for j, i in enumerate(seqs) if i in self.tree_masks}
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:0],  # K/V are already stored
            query_lens=[self.query_lens[i] for i in seqs],
            context_lens=self.context_lens.index_select(0, index.to(self.context_lens.device)),
            block_tables=self.block_tables.index_select(0, index),
            block_size=self.block_size,
            use_triton=self.use_triton,
            tree_masks=trees,
        )

    def tree_bits(self) -> torch.Tensor:
        """(T,) int64: bit a of a new token's entry is set when it sees its sequence's new token
        a (causal rows for sequences without a tree). Only for query lengths up to 64."""
        if self._tree_bits is None:
            bits: list[int] = []
            for i, n in enumerate(self.query_lens):
                assert n <= 64, n
                tree = self.tree_masks.get(i)
                for r in range(n):
                    seen = range(r + 1) if tree is None else tree[r].nonzero().flatten().tolist()
                    v = sum(1 << a for a in seen)
                    bits.append(v - (1 << 64) if v >= 1 << 63 else v)  # as a signed int64
            self._tree_bits = torch.tensor(bits, dtype=torch.int64, device=self.slot_mapping.device)
        return self._tree_bits

    @property
    def is_mixed(self) -> bool:
        """Sequences with different query lengths (only the torch path needs to split them)."""
        return len(set(self.query_lens)) > 1

    def kv_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets in the block) of the new tokens, (T,) each."""
        if self._kv_index is None:
            self._kv_index = (
                self.slot_mapping // self.block_size,
                self.slot_mapping % self.block_size,
            )
        return self._kv_index


@dataclass(slots=True)
class _TorchPlan:
    """Index and mask tensors for the torch path, computed once per forward pass."""

    fresh_prompt: bool  # one sequence, no earlier context: attend over the new K/V directly
    blocks: torch.Tensor  # (B, num_blocks) block ids actually read
    num_keys: int  # keys gathered per sequence: the longest context
    max_q: int
    valid_q: torch.Tensor | None  # (B, max_q) bool; None when every sequence has max_q queries
    mask: torch.Tensor | None  # (B, 1, max_q, num_keys) bool; None when nothing is masked
    tile_index: torch.Tensor | None = None  # (B * H_kv * num_blocks,) set by the first gather
    bias: torch.Tensor | None = None  # (B * H_kv, 1, num_keys) additive mask of decode batches

    @staticmethod
    def build(meta: AttentionMetadata, fresh_ok: bool = True) -> _TorchPlan:
        ctx = meta.context_lens.tolist()
        q_lens = meta.query_lens
        B, bs = len(q_lens), meta.block_size
        dev = meta.block_tables.device
        fresh = fresh_ok and B == 1 and ctx[0] == q_lens[0] and not meta.tree_masks
        if fresh:  # attends over the new K/V directly: nothing to gather or mask
            empty = torch.empty(0, dtype=torch.int64, device=dev)
            return _TorchPlan(True, empty.view(1, 0), 0, q_lens[0], None, None)
        num_blocks = -(-max(ctx) // bs)
        blocks = meta.block_tables[:, :num_blocks]
        max_q = max(q_lens)
        num_keys = max(ctx)
        valid_q = None
        if any(q != max_q for q in q_lens):
            valid_q = torch.arange(max_q)[None, :] < torch.tensor(q_lens)[:, None]
        mask = None
        if max_q > 1 or (B > 1 and any(c != num_keys for c in ctx)):
            ctx_t = torch.tensor(ctx, dtype=torch.int64)
            q_pos = (ctx_t - torch.tensor(q_lens))[:, None] + torch.arange(max_q)[None, :]
            k_pos = torch.arange(num_keys)
            mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
                k_pos[None, None, :] < ctx_t[:, None, None]
            )
            for i, tree in meta.tree_masks.items():  # new tokens see only their tree ancestors
                q, c = q_lens[i], ctx[i]
                mask[i, :q, c - q : c] = tree.to(mask.device)
            mask = mask.unsqueeze(1).to(dev)
        return _TorchPlan(
            fresh_prompt=False,
            blocks=blocks,
            num_keys=num_keys,
            max_q=max_q,
            valid_q=None if valid_q is None else valid_q.to(dev),
            mask=mask,
        )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store new keys/values. k_cache: (num_blocks, block_size, H_kv, D); k: (T, H_kv, D);
    kv_scales: the fp8 or int8 pool's K and V scales (``KVPool.layer_scales``)."""
    index = meta.kv_index()
    if kv_scales is not None and k_cache.dtype == kv_int8.INT8_DTYPE:
        kv_int8.store(k_cache, kv_scales[0], k, *index)
        kv_int8.store(v_cache, kv_scales[1], v, *index)
        return
    if kv_scales is not None:
        kv_quant.store(k_cache, kv_scales[0], k, *index)
        kv_quant.store(v_cache, kv_scales[1], v, *index)
        return
    k_cache.index_put_(index, k.to(k_cache.dtype))
    v_cache.index_put_(index, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q: (T, H_q, D); k, v: (T, H_kv, D) for the new tokens. Returns (T, H_q, D).
    ``kv_scales``: the K and V scales of an fp8 or int8 cache (``KVPool.layer_scales``)."""
    if meta.tree_rows is not None:
        raise ValueError("draft-tree rows (TreeRows) run on the C decode kernels only")
    write_kv(k_cache, v_cache, k, v, meta, kv_scales)
    if meta.use_triton and meta.tree_masks and max(meta.query_lens) <= 64:
        from kvmesh.kernels.paged_attention import paged_tree_attention

        return paged_tree_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.context_lens,
            meta.query_lens,
            meta.tree_bits(),
            scale,
            kv_scales=kv_scales,
        )
    if meta.is_mixed:
        out = torch.empty_like(q)
        for rows, part in meta.parts():
            out[rows] = _attend(q[rows], k[rows], v[rows], k_cache, v_cache, part, scale, kv_scales)
        return out
    return _attend(q, k, v, k_cache, v_cache, meta, scale, kv_scales)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of already-stored K/V: q (T, H_q, D) -> (T, H_q, D)."""
    if meta.use_triton and meta.is_decode_only:
        from kvmesh.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, kv_scales=kv_scales
        )
    plan = meta.torch_plan(fresh_ok=kv_scales is None)
    if plan.fresh_prompt:
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
    k_scales, v_scales = (None, None) if kv_scales is None else kv_scales
    keys = _gather(k_cache, plan, q.dtype, k_scales)  # (B, H_kv, num_keys, D)
    values = _gather(v_cache, plan, q.dtype, v_scales)
    if plan.max_q == 1:
        return _decode_attention_torch(q, keys, values, plan, scale)
    return _paged_attention_torch(q, keys, values, plan, scale)


def _gather(
    cache: torch.Tensor,
    plan: _TorchPlan,
    dtype: torch.dtype,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, H_kv, num_keys, D) keys or values of every sequence, read through its block table."""
    # cache: (num_blocks, block_size, H_kv, D) view of head-major blocks. In memory every
    # (block, head) pair is one contiguous (block_size, D) tile, so index those tiles directly:
    # one index_select lands them in SDPA's (B, H, keys, D) order with a single copy.
    heads = cache.transpose(1, 2)  # (num_blocks, H_kv, block_size, D)
    N, H, bs, D = heads.shape
    tiles = heads.as_strided((N * H, bs, D), (heads.stride(1), heads.stride(2), heads.stride(3)))
    B, nb = plan.blocks.shape
    if plan.tile_index is None:
        heads_ids = torch.arange(H, device=plan.blocks.device)
        plan.tile_index = (plan.blocks[:, None, :] * H + heads_ids[None, :, None]).reshape(-1)
    out = tiles.index_select(0, plan.tile_index)  # (B * H * nb, bs, D)
    if scales is not None and cache.dtype == kv_int8.INT8_DTYPE:
        # (num_blocks, block_size, H_kv, G) int8 scales: the same tiles of (block_size, G)
        s = scales.transpose(1, 2)
        s_tiles = s.as_strided((N * H, bs, s.shape[3]), (s.stride(1), s.stride(2), s.stride(3)))
        out = kv_int8.dequantize(out, s_tiles.index_select(0, plan.tile_index))
    elif scales is not None:  # (num_blocks, H_kv) fp8 scales, one per tile likewise
        tile_scales = scales.as_strided((N * H,), (scales.stride(1),))
        out = kv_quant.dequantize(out, tile_scales.index_select(0, plan.tile_index)[:, None])
    out = out.view(B, H, nb * bs, D)[:, :, : plan.num_keys]
    return out if out.dtype == dtype else out.to(dtype)


def _decode_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: _TorchPlan,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: grouped-query attention as two batched matmuls over (sequence,
    KV head) pairs; a little faster than SDPA's flash kernel, built for long query blocks.
    keys, values: (B, H_kv, num_keys, D) as ``_gather`` reads them."""
    B, H_q, D = q.shape
    H_kv, n = keys.shape[1], keys.shape[2]
    # Query heads of one KV head are adjacent (transformers' repeat_kv order).
    q = q.reshape(B * H_kv, H_q // H_kv, D)
    keys_t = keys.reshape(B * H_kv, n, D).transpose(1, 2)  # (B * H_kv, D, n)
    if plan.mask is None:
        scores = torch.bmm(q, keys_t).mul_(scale)
    else:
        if plan.bias is None:  # shorter contexts than the longest: -inf past their ends
            bias = torch.zeros(plan.mask.shape, dtype=q.dtype, device=q.device)
            bias.masked_fill_(~plan.mask, float("-inf"))  # (B, 1, 1, n)
            plan.bias = bias.expand(B, H_kv, 1, n).reshape(B * H_kv, 1, n)
        scores = torch.baddbmm(plan.bias, q, keys_t, alpha=scale)
    probs = scores.softmax(-1)  # (B * H_kv, group, n)
    out = torch.bmm(probs, values.reshape(B * H_kv, n, D))
    return out.view(B, H_q, D)


def _paged_attention_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: _TorchPlan,
    scale: float,
) -> torch.Tensor:
    B = plan.blocks.shape[0]
    T, H_q, D = q.shape
    if plan.valid_q is None:
        q_pad = q.view(B, plan.max_q, H_q, D)
    else:  # packed queries -> (B, max_q, H_q, D)
        q_pad = q.new_zeros(B, plan.max_q, H_q, D)
        q_pad[plan.valid_q] = q
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),  # (B, H_q, max_q, D)
        keys,
        values,
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=True,
    )  # (B, H_q, max_q, D)
    out = out.transpose(1, 2)
    return out.reshape(T, H_q, D) if plan.valid_q is None else out[plan.valid_q]
