"""Runs one forward pass for a scheduled batch.

Packs the batch's new tokens (``num_new_tokens[i]`` per sequence, starting after each sequence's
computed ones), builds the AttentionMetadata with a handful of small tensors, runs the model under
``torch.inference_mode`` and computes logits only for the rows that are wanted: the last
``num_logits[i]`` new tokens of sequence ``i`` (1 to sample, K+1 to verify K drafts, 0 mid-prefill).

A sequence verifying a draft tree (``trees[i]``) brings its last token and then the tree's nodes
as its new tokens: they take consecutive KV slots in node order, but node ``j`` sits at RoPE
position ``last + depth(j)`` and attends only to its ancestors among the new tokens. A chain
needs no mask: each of its tokens becomes a one-query row of its own (``_one_query_rows``), so a
step verifying only chains is a decode batch and runs the decode kernels. Where the C decode
kernels run the step (CPU, float32 model, a cache they read: float32, float16, bfloat16, fp8 or
int8) and every other sequence decodes one token, trees become one-query rows too: node ``j``'s
row reads its ancestors' slots through ``TreeRows``, and computes what a plain decode step at its
position would, bit for bit.
Elsewhere a tree is verified by its mask (the torch path; Triton's tree kernel on CUDA).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.model.attention import AttentionMetadata, TreeRows
from kvmesh.shared.model.backend import select_backend


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_pool: KVPool,
        device: str | torch.device = "cpu",
        cpu_kernels: bool = True,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = kv_pool.spec.block_size
        self.device = torch.device(device)
        # the kernels, chosen once: installed on the model here, planning each step in prepare
        self.backend = select_backend(self.device, cpu_kernels)
        self.backend.install(model)  # the torch backend also undoes an earlier engine's kernels
        self.use_triton = self.backend.use_triton
        self.cpu_ops = self.backend.cpu_ops
        # trees as one-query rows (TreeRows): only the C decode kernels read them
        self.tree_rows = self.backend.decodes_in_c(kv_pool.spec)

    def prepare(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        trees: Mapping[int, DraftTree] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        B = len(seqs)
        input_ids: list[int] = []
        positions: list[int] = []
        context_lens: list[int] = []
        for seq, n in zip(seqs, num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            assert n > 0 and len(seq.block_table) * bs >= end, (seq.request_id, n, end)
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            context_lens.append(end)
        max_blocks = -(-max(context_lens) // bs)
        tables = [s.block_table[:max_blocks] for s in seqs]
        for t in tables:
            t += [0] * (max_blocks - len(t))
        dev = self.device
        block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)  # (B, max_blocks)
        if len(positions) == B:  # decode-only: one slot per sequence, cheaper in Python
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
            pos = torch.tensor(positions, dtype=torch.int64, device=dev)  # (T,)
        else:
            pos = torch.tensor(positions, dtype=torch.int64, device=dev)
            seq_idx = torch.repeat_interleave(
                torch.arange(B, device=dev), torch.tensor(num_new_tokens, device=dev)
            )
            slot_mapping = block_tables[seq_idx, pos // bs] * bs + pos % bs
        tree_masks = {}
        tree_rows = None
        query_lens = list(num_new_tokens)
        if trees:
            chains = {i: tree for i, tree in trees.items() if tree.is_chain}
            masked = {i: tree for i, tree in trees.items() if not tree.is_chain}
            rows = dict(chains)  # a chain's tokens sit at causal positions: one row each
            if (
                masked
                and self.tree_rows
                and all(n == 1 or i in trees for i, n in enumerate(num_new_tokens))
            ):
                rows, masked = dict(trees), {}  # a decode batch: trees as rows too
            others = {i: tree for i, tree in trees.items() if i not in chains}
            if others:
                pos, masks = _tree_positions(seqs, num_new_tokens, others, positions)
                pos = pos.to(dev)
                tree_masks = {i: mask for i, mask in masks.items() if i in masked}
            if rows:
                query_lens, context_lens, tables, tree_masks, tree_rows = _one_query_rows(
                    rows, num_new_tokens, context_lens, tables, tree_masks
                )
                block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_lens=query_lens,
            context_lens=torch.tensor(context_lens, dtype=torch.int64, device=dev),
            block_tables=block_tables,
            block_size=bs,
            use_triton=self.use_triton,
            tree_masks=tree_masks,
            tree_rows=tree_rows,
        )
        meta.cpu_plan = self.backend.plan_step(meta, self.kv_pool)
        return torch.tensor(input_ids, dtype=torch.int64, device=dev), pos, meta

    @torch.inference_mode()
    def execute(
        self,
        seqs: list[Sequence],
        num_new_tokens: list[int],
        num_logits: list[int],
        trees: Mapping[int, DraftTree] | None = None,
    ) -> torch.Tensor | None:
        """Forward the batch; returns (sum(num_logits), vocab) float32 logits, or None if no row
        is wanted (every sequence is mid-prefill). ``trees``: sequence index -> the draft tree
        whose nodes follow its last token among its ``num_new_tokens``."""
        input_ids, positions, meta = self.prepare(seqs, num_new_tokens, trees)
        hidden = self.model(input_ids, positions, self.kv_pool, meta)  # (T, hidden)
        if not any(num_logits):
            return None
        if all(k == n for k, n in zip(num_logits, num_new_tokens, strict=True)):
            return self.model.compute_logits(hidden)
        rows: list[int] = []
        end = 0
        for n, k in zip(num_new_tokens, num_logits, strict=True):
            end += n
            rows += range(end - k, end)
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))


def _one_query_rows(
    trees: Mapping[int, DraftTree],
    num_new_tokens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    tree_masks: dict[int, torch.Tensor],
) -> tuple[list[int], list[int], list[list[int]], dict[int, torch.Tensor], TreeRows | None]:
    """The attention's rows when the sequences of ``trees`` verify them as one-query rows:
    each of their new tokens becomes a row of its own over the sequence's block table. A chain
    node's context is the sequence up to and including itself (causal attention over a chain
    is exactly that); a tree node's is the sequence up to its last token, then the node's
    ancestors and itself, read through ``TreeRows`` (only when some tree is not a chain). A
    batch of one-query rows is a decode batch: the decode kernels (the fused C layer, Triton's
    decode kernel) verify drafts as they decode, and the result of every row is the one a plain
    decode step at its position gives. Returns query lengths, context lengths, tables, the
    other sequences' tree masks under their row indices, and the tree rows."""
    query_lens: list[int] = []
    ctx: list[int] = []
    rows: list[list[int]] = []
    masks = {}
    starts: list[int] = []
    offsets: list[int] = []
    positions: list[int] = []
    for i, (n, c, table) in enumerate(zip(num_new_tokens, context_lens, tables, strict=True)):
        tree = trees.get(i)
        if tree is None:
            if i in tree_masks:
                masks[len(query_lens)] = tree_masks[i]
            query_lens.append(n)
            ctx.append(c)
            rows.append(table)
            starts.append(c)
            offsets.append(len(positions))
            continue
        last = c - n  # the sequence's last token; its nodes follow in node order
        query_lens += [1] * n
        rows += [table] * n
        ctx.append(last + 1)
        starts.append(last + 1)
        offsets.append(len(positions))
        for j in range(len(tree)):
            path = tree.path(j)
            ctx.append(last + 1 + len(path))
            starts.append(last + 1)
            offsets.append(len(positions))
            positions += [last + 1 + a for a in path]
    tree_rows = None
    if not all(tree.is_chain for tree in trees.values()):
        tree_rows = TreeRows(
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(offsets, dtype=torch.int64),
            torch.tensor(positions or [0], dtype=torch.int64),
        )
    return query_lens, ctx, rows, masks, tree_rows


def _tree_positions(
    seqs: list[Sequence],
    num_new_tokens: list[int],
    trees: Mapping[int, DraftTree],
    positions: list[int],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """RoPE positions with each tree's nodes at ``last + depth``, and the tree masks: row 0 is
    the last token (sees itself), row ``1 + j`` node ``j`` (sees the last token and its path)."""
    pos = list(positions)
    masks = {}
    start = 0
    for i, (seq, n) in enumerate(zip(seqs, num_new_tokens, strict=True)):
        tree = trees.get(i)
        if tree is not None:
            assert n == len(tree) + 1 and seq.num_computed_tokens + n <= len(seq), (i, n)
            last = seq.num_computed_tokens
            pos[start + 1 : start + n] = [last + d for d in tree.depths]
            mask = torch.zeros(n, n, dtype=torch.bool)
            mask[:, 0] = True
            for j, bits in enumerate(tree.ancestor_masks()):
                mask[1 + j, 1:] = torch.tensor([(bits >> a) & 1 == 1 for a in range(n - 1)])
            masks[i] = mask
        start += n
    return torch.tensor(pos, dtype=torch.int64), masks
