"""Speculative verification: score K draft tokens per sequence in one pass, accept, roll back.

``DraftVerifier.score`` appends each sequence's drafts and computes their KV and logits in one
forward pass (row i of a sequence's logits: after its last token + drafts[:i]). The drafts then sit
in the sequence with their KV until ``accept`` drops the rejected ones and appends the next token,
or ``rollback`` drops the last tokens. Blocks no longer used are freed; a shared block about to be
rewritten is copied first.

Draft trees (``LLMEngine.step(drafts)``): ``can_verify`` says whether a tree fits a sequence this
step, ``append_tree`` puts its nodes after the last token (KV slots in node order), and
``keep_path`` keeps only the accepted path: its nodes' KV moves to consecutive slots after the last
token, every other node is dropped with the blocks it alone used, and the +1 token is appended.
``score_trees`` is the same forward pass without acceptance (a drafter's tree expansion): it
returns every node's logits, then ``keep_path`` keeps a path or ``rollback`` drops every node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from kvmesh.shared.engine.block_manager import BlockManager, OutOfBlocksError
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.finish import stop_text_for
from kvmesh.shared.engine.model_runner import ModelRunner
from kvmesh.shared.engine.sequence import RequestError, Sequence, SequenceStatus
from kvmesh.shared.kv import kv_int8, kv_quant
from kvmesh.shared.kv.kv_cache import KVPool
from kvmesh.shared.text.detokenize import TokenDecoder


@dataclass(frozen=True, slots=True)
class SpecStepStats:
    """Draft verification in one engine step (``LLMEngine.last_spec_step``)."""

    num_verified_seqs: int  # sequences whose tree was verified this step
    num_ignored_trees: int  # trees for sequences not decoding, or that did not fit
    num_draft_tokens: int  # tree nodes verified
    num_draft_positions: int  # sum of tree depths: the most that could have been accepted
    num_accepted_tokens: int  # nodes on the accepted paths
    verify_time_s: float  # wall time of the whole step that verified them


@dataclass(slots=True)
class SpecTotals:
    """Running sums of ``SpecStepStats`` over an engine's life (``LLMEngine.spec_totals``)."""

    num_verify_steps: int = 0
    num_verified_seqs: int = 0
    num_ignored_trees: int = 0
    num_draft_tokens: int = 0
    num_draft_positions: int = 0
    num_accepted_tokens: int = 0
    verify_time_s: float = 0.0

    def add(self, step: SpecStepStats) -> None:
        self.num_verify_steps += 1
        self.num_verified_seqs += step.num_verified_seqs
        self.num_ignored_trees += step.num_ignored_trees
        self.num_draft_tokens += step.num_draft_tokens
        self.num_draft_positions += step.num_draft_positions
        self.num_accepted_tokens += step.num_accepted_tokens
        self.verify_time_s += step.verify_time_s


@dataclass(eq=False)
class DraftVerifier:
    """Scores, accepts and rolls back draft tokens of an engine's sequences, in its KV cache."""

    block_manager: BlockManager
    kv_pool: KVPool
    runner: ModelRunner
    tokenizer: TokenDecoder | None
    max_seq_len: int
    vocab_size: int

    def score(
        self, seqs: list[Sequence], drafts: Mapping[str, list[int]]
    ) -> dict[str, torch.Tensor]:
        """Score each sequence's drafts (``drafts[seq.request_id]``, ``seqs`` in the order of
        ``drafts``) in one forward pass; returns logits ``(K+1, vocab)`` per request."""
        bm = self.block_manager
        for seq in seqs:
            k = len(drafts[seq.request_id])
            if (
                seq.status is not SequenceStatus.RUNNING
                or seq.prefill_only
                or seq.num_uncomputed_tokens != 1
            ):
                raise RequestError(
                    f"request {seq.request_id!r} is not decoding; only decoding requests can be scored"
                )
            if len(seq) + k > self.max_seq_len:
                raise RequestError(
                    f"request {seq.request_id!r}: {k} drafts would pass the length limit {self.max_seq_len}"
                )
            if not bm.can_append(seq, k + 1):
                raise OutOfBlocksError(
                    f"no free KV blocks to score {k} drafts for {seq.request_id!r}"
                )
        num_new = []
        for seq in seqs:
            draft = drafts[seq.request_id]
            bm.append_slots(seq, len(draft) + 1)
            seq.token_ids += draft
            num_new.append(len(draft) + 1)
        logits = self.runner.execute(seqs, num_new, num_new)
        for seq, n in zip(seqs, num_new, strict=True):
            seq.num_computed_tokens += n
        return dict(zip(drafts, logits.split(num_new), strict=True))

    def can_verify(self, seq: Sequence, tree: DraftTree) -> bool:
        """Whether ``tree`` can be verified for ``seq`` in this step: the sequence is decoding
        (scheduled for its one last token), the tree is non-empty, its tokens are in the
        vocabulary, and its nodes fit the length limit and the free blocks."""
        return (
            len(tree) > 0
            and seq.status is SequenceStatus.RUNNING
            and not seq.prefill_only
            and seq.num_uncomputed_tokens == 1
            and len(seq) + len(tree) <= self.max_seq_len
            and all(t < self.vocab_size for t in tree.tokens)
            and self.block_manager.can_append(seq, len(tree) + 1)
        )

    def append_tree(self, seq: Sequence, tree: DraftTree) -> None:
        """Slots and tokens for the tree's nodes after the last token (``can_verify`` first)."""
        self.block_manager.append_slots(seq, len(tree) + 1)
        seq.token_ids += tree.tokens

    def score_trees(
        self, seqs: list[Sequence], trees: list[DraftTree]
    ) -> list[torch.Tensor | None]:
        """Score each sequence's tree in one forward pass, as a verify step does (tree mask or
        tree rows): logits ``(len(tree) + 1, vocab)`` per sequence, row 0 after its last token,
        row ``1 + j`` after node ``j``; None for a tree that ``can_verify`` refuses (checked in
        order, so the blocks the trees take add up). A scored tree's nodes then sit after the
        last token with their KV and the last token counts as uncomputed, as in a verify step
        before acceptance: ``keep_path`` or ``rollback(seq, len(tree))`` must follow."""
        index: list[int] = []  # scored trees' positions in ``seqs``
        for i, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
            if self.can_verify(seq, tree):
                self.append_tree(seq, tree)
                index.append(i)
        out: list[torch.Tensor | None] = [None] * len(seqs)
        if not index:
            return out
        num_new = [len(trees[i]) + 1 for i in index]
        batch = [seqs[i] for i in index]
        logits = self.runner.execute(
            batch, num_new, num_new, dict(enumerate(trees[i] for i in index))
        )
        assert logits is not None
        for i, rows in zip(index, logits.split(num_new), strict=True):
            out[i] = rows
        return out

    def check_scored(
        self, seq: Sequence, tree: DraftTree, path: tuple[int, ...], next_token: int
    ) -> None:
        """RequestError unless ``keep_path(seq, tree, path, next_token)`` may follow: the tree
        was just scored for ``seq``, ``path`` runs down from its root, the token is valid."""
        rid = seq.request_id
        num_nodes = len(tree)
        if seq.num_computed_tokens != len(seq) - num_nodes - 1 or seq.token_ids[
            len(seq) - num_nodes :
        ] != list(tree.tokens):
            raise RequestError(f"request {rid!r}: keep_path follows score_trees of the same tree")
        if path and (not 0 <= path[-1] < num_nodes or tree.path(path[-1]) != list(path)):
            raise RequestError(f"request {rid!r}: {list(path)} is not a path from the root")
        if not 0 <= next_token < self.vocab_size:
            raise RequestError(f"request {rid!r}: token id {next_token} is outside the vocabulary")

    def keep_path(
        self, seq: Sequence, tree: DraftTree, path: tuple[int, ...], next_token: int
    ) -> None:
        """After the forward pass over ``append_tree``'s tokens: keep the nodes of ``path`` (a
        root-to-node path of ``tree``) with their KV, drop the other nodes, append ``next_token``."""
        num_nodes = len(tree)
        last = len(seq) - num_nodes - 1  # slot of the sequence's last token
        assert seq.num_computed_tokens == last, (seq.num_computed_tokens, last)
        assert tree.path(path[-1]) == list(path) if path else True, path
        self._move_kv(seq, [(last + 1 + node, last + 1 + d) for d, node in enumerate(path)])
        del seq.token_ids[last + 1 :]
        seq.token_ids += [tree.tokens[node] for node in path]
        seq.token_ids.append(next_token)
        seq.num_computed_tokens = last + 1 + num_nodes
        self._truncate(seq, len(seq), last + 1 + len(path))

    def _move_kv(self, seq: Sequence, moves: list[tuple[int, int]]) -> None:
        """Copy the KV of token slot ``src`` to slot ``dst`` (positions in the sequence, every
        layer, K and V), in order; ``dst <= src`` and earlier moves never overwrite later sources."""
        bs = self.block_manager.block_size
        pool = self.kv_pool.tensor  # (num_blocks, H_kv, L, 2, block_size, D)
        for src, dst in moves:
            if src == dst:
                continue
            assert dst < src, (src, dst)
            sb, so = seq.block_table[src // bs], src % bs
            db, do = seq.block_table[dst // bs], dst % bs
            if self.kv_pool.scales is None:
                pool[db, :, :, :, do] = pool[sb, :, :, :, so]
            elif self.kv_pool.spec.is_int8:  # the token's bytes and its own scales
                kv_int8.move_token(pool, self.kv_pool.scales, (sb, so), (db, do))
            else:  # fp8: the two blocks may have different scales
                kv_quant.move_token(pool, self.kv_pool.scales, (sb, so), (db, do))

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` output tokens and their KV; the sequence is left decoding
        from its new last token."""
        if seq.status is not SequenceStatus.RUNNING:
            raise RequestError(f"request {seq.request_id!r} is not running; cannot roll it back")
        if not 0 <= num_tokens <= seq.num_output_tokens or num_tokens >= len(seq):
            raise RequestError(
                f"request {seq.request_id!r}: can roll back 0..{seq.num_output_tokens} output tokens, not {num_tokens}"
            )
        if num_tokens:
            new_len = len(seq) - num_tokens
            self._truncate(seq, new_len, min(seq.num_computed_tokens, new_len - 1))

    def accept(self, seq: Sequence, num_accepted: int, next_token: int) -> None:
        """After ``score``: keep the first ``num_accepted`` drafts (their KV stays), drop the rest
        and append ``next_token`` (not yet stop-checked nor returned)."""
        num_drafts = seq.num_computed_tokens - (seq.num_prompt_tokens + seq.num_emitted_tokens)
        if seq.num_uncomputed_tokens != 0 or not 0 <= num_accepted <= num_drafts:
            raise RequestError(
                f"request {seq.request_id!r}: accept follows score, with 0..{num_drafts} accepted drafts"
            )
        if not 0 <= next_token < self.vocab_size:
            raise RequestError(
                f"request {seq.request_id!r}: token id {next_token} is outside the vocabulary"
            )
        keep = len(seq) - (num_drafts - num_accepted)
        self._truncate(seq, keep, keep)
        seq.token_ids.append(next_token)

    def _truncate(self, seq: Sequence, num_tokens: int, num_computed: int) -> None:
        for src, dst in self.block_manager.truncate(seq, num_tokens, num_computed):
            self.kv_pool.block_bytes_view(dst).copy_(self.kv_pool.block_bytes_view(src))
        seq.num_emitted_tokens = min(seq.num_emitted_tokens, seq.num_output_tokens)
        del seq.logprobs[seq.num_output_tokens :]
        if seq.stop_text is not None and seq.stop_text.num_tokens > seq.num_emitted_tokens:
            # Emitted tokens were dropped: the stop-string text starts over from what is kept.
            seq.stop_text = stop_text_for(seq, self.tokenizer)
