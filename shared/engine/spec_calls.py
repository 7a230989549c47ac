"""LLMEngine's speculative verification calls, lower level (decode side; call between steps)::

    engine.score(request_id, draft_ids) -> logits (K+1, vocab)  # row i: after last token + drafts[:i]
    engine.score_batch({request_id: draft_ids}) -> {request_id: logits}   # one forward pass
    engine.accept(request_id, num_accepted, next_token) -> RequestOutput  # keep drafts[:n] + next
    engine.rollback(request_id, num_tokens)    # drop the last tokens and their KV, back to decode
    engine.score_trees({request_id: DraftTree}) -> {request_id: logits (len+1, vocab)}  # one pass
    engine.keep_path(request_id, tree, path, next_token) -> RequestOutput  # or rollback(len(tree))

After ``score`` the drafts sit in the sequence with their KV; ``accept`` (or ``rollback(K)``)
must follow before the next ``step``; after ``score_trees`` (a drafter scoring its own tree, row 0
after the last token, row 1 + j after node j), ``keep_path`` or ``rollback(len(tree))``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from kvmesh.shared.engine.block_manager import BlockManager
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.sequence import RequestOutput, Sequence
from kvmesh.shared.engine.speculative import DraftVerifier


class SpecCalls:
    """The calls above, over the engine's ``DraftVerifier`` (LLMEngine inherits them)."""

    verifier: DraftVerifier
    block_manager: BlockManager
    _get: Callable[[str], Sequence]  # the request's sequence, or UnknownRequestError
    _emit: Callable[[Sequence], RequestOutput]  # stop-check its new tokens, build their output

    def score_batch(self, drafts: Mapping[str, list[int]]) -> dict[str, torch.Tensor]:
        """Score each request's draft tokens in one forward pass (KV of the drafts is written)."""
        return self.verifier.score([self._get(rid) for rid in drafts], drafts)

    def score(self, request_id: str, draft_ids: list[int]) -> torch.Tensor:
        return self.score_batch({request_id: draft_ids})[request_id]

    def score_trees(self, trees: Mapping[str, DraftTree]) -> dict[str, torch.Tensor]:
        """Score decoding requests' trees in one forward pass as ``step(drafts)`` does, without
        acceptance: logits ``(len(tree) + 1, vocab)`` each; trees that do not fit left out."""
        ids = list(trees)
        logits = self.verifier.score_trees([self._get(rid) for rid in ids], list(trees.values()))
        return {rid: rows for rid, rows in zip(ids, logits, strict=True) if rows is not None}

    def keep_path(
        self, request_id: str, tree: DraftTree, path: tuple[int, ...], next_token: int
    ) -> RequestOutput:
        """After ``score_trees``: keep ``path``'s nodes with their KV, drop the others, append
        ``next_token``; returns the output for the path's tokens plus it."""
        seq = self._get(request_id)
        self.verifier.check_scored(seq, tree, path, next_token)
        self.verifier.keep_path(seq, tree, path, next_token)
        self.block_manager.commit(seq)
        return self._emit(seq)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens and their KV; blocks no longer used are freed. The
        sequence is left decoding from its new last token."""
        self.verifier.rollback(self._get(request_id), num_tokens)

    def accept(self, request_id: str, num_accepted: int, next_token: int) -> RequestOutput:
        """After ``score``: keep the first ``num_accepted`` drafts (their KV stays), append
        ``next_token`` and return the output for the accepted drafts plus it."""
        seq = self._get(request_id)
        self.verifier.accept(seq, num_accepted, next_token)
        return self._emit(seq)
