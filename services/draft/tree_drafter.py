"""EngineTreeDrafter: draft trees from a model in its own engine (early exit, or a draft model).

All jobs of a batch go through the draft engine together, in four phases:

1. Prefill: each context is added as a request (prefix caching: only what was appended since
   the last draft is computed) and stepped until it has its first token, the draft model's
   greedy token after the context. The tokens are rolled back, so the context's last token is
   the one to compute again: it is the root of the tree.
2. K tree passes (``TreeExpansion``): pass d scores, in one forward pass with the tree attention
   mask (``LLMEngine.score_trees``, the verification path of decode workers), every node
   shallower than d plus the greedy node at depth d; each node's children are its W likeliest
   tokens. The nodes are rolled back after each pass; after the last one only the greedy path
   is kept (``LLMEngine.keep_path``), with the token after it.
3. Lookahead: plain greedy steps until the greedy path is K + lookahead deep.
4. Each request ends (aborted once it has its tokens) and leaves in the prefix cache exactly
   what the chain drafter leaves after drafting that greedy path: the context and the path.
   No KV of any other node stays.

A sequence the engine cannot place (no blocks, too long) gets the tree decided so far (empty if
it never had its first token).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.services.draft.core import DraftSnapshot
from kvmesh.services.draft.drafters import EngineDrafter, Tree
from kvmesh.services.draft.shape import TreeShape
from kvmesh.services.draft.tree_expansion import TreeExpansion


class EngineTreeDrafter(EngineDrafter):
    """Trees of ``shape`` (K levels) with ``lookahead`` greedy tokens below their likeliest
    path: ``depth`` = K + lookahead."""

    def __init__(self, engine: Any, shape: TreeShape, lookahead: int) -> None:
        super().__init__(engine, shape.depth + lookahead)
        self.shape = shape
        self.lookahead = lookahead
        # context tokens this drafter computed itself (the rest were prefix-cache hits)
        self.num_computed_tokens = 0

    def propose(self, jobs: Sequence[DraftSnapshot]) -> list[Tree]:
        from kvmesh.shared.engine.block_manager import OutOfBlocksError
        from kvmesh.shared.engine.sequence import RequestError
        from kvmesh.shared.text.sampling import SamplingOptions

        engine = self.engine
        # + 1: the request must not end at ``depth`` tokens before its tree is drafted; it is
        # aborted once it has them
        params = SamplingOptions(max_tokens=self.depth + 1, temperature=0.0, ignore_eos=True)
        ids: dict[str, int] = {}
        num_hits, num_context = engine.block_manager.num_hit_tokens, 0
        for i, job in enumerate(jobs):
            assert not job.ahead, "trees are drafted anew (DraftCore pipeline_depth 0)"
            if job.position + self.depth + 1 > engine.max_seq_len:
                continue
            self._num_requests += 1
            rid = f"draft-{self._num_requests}"
            try:
                engine.add_request(rid, list(job.context), params)
            except (RequestError, OutOfBlocksError):
                continue
            ids[rid] = i
            num_context += job.position
        trees: dict[str, TreeExpansion] = {}
        try:
            for rid, first in self._prefill(ids).items():
                trees[rid] = TreeExpansion.start(self.shape.widths, self.lookahead, first)
            self._decode_lookahead(trees, self._expand(trees))
        finally:
            for rid in ids:
                engine.abort(rid)  # False for those already ended
            while engine.has_unfinished():  # the aborted requests' last outputs
                engine.step()
            num_hits = engine.block_manager.num_hit_tokens - num_hits
            self.num_computed_tokens += num_context - num_hits
        out: list[Tree] = [((), ()) for _ in jobs]
        for rid, expansion in trees.items():
            out[ids[rid]] = expansion.tree()
        return out

    def _prefill(self, ids: dict[str, int]) -> dict[str, int]:
        """Step until every request has its first token; returns those tokens, for the requests
        left decoding from their context's last token (outputs rolled back)."""
        from kvmesh.shared.engine.sequence import RequestError

        engine = self.engine
        first: dict[str, int] = {}
        num_out: dict[str, int] = {}
        ended: set[str] = set()
        while engine.has_unfinished() and any(r not in first and r not in ended for r in ids):
            for out in engine.step():
                if out.request_id not in ids:
                    continue
                if out.new_token_ids:
                    first.setdefault(out.request_id, out.new_token_ids[0])
                num_out[out.request_id] = out.num_output_tokens
                if out.finished:
                    ended.add(out.request_id)
        decoding = {}
        for rid, token in first.items():
            if rid in ended:
                continue
            try:
                engine.rollback(rid, num_out[rid])
            except RequestError:  # preempted while others prefilled: nothing to score
                continue
            decoding[rid] = token
        for rid in set(ids) - set(decoding):
            engine.abort(rid)  # no tree: it must not decode in the steps that follow
        return decoding

    def _expand(self, trees: dict[str, TreeExpansion]) -> set[str]:
        """The K tree passes. Returns the requests that hold their greedy path afterwards; one
        the engine could not score (no blocks for its nodes) keeps the tree it has."""
        from kvmesh.shared.engine.draft_tree import DraftTree

        engine = self.engine
        growing = set(trees)
        for level in range(1, self.shape.depth + 1):
            nodes = {rid: trees[rid].pass_nodes(level) for rid in growing}
            drafts = {rid: DraftTree(*trees[rid].subtree(n)) for rid, n in nodes.items()}
            logits = engine.score_trees(drafts)
            for rid in sorted(growing):
                rows = logits.get(rid)
                if rows is None:
                    growing.discard(rid)
                    continue
                expansion = trees[rid]
                ranked = rows.topk(min(expansion.max_rank, rows.shape[-1])).indices.tolist()
                expansion.expand(nodes[rid], ranked)
                if level < self.shape.depth:
                    engine.rollback(rid, len(drafts[rid]))
                else:
                    path, next_token = expansion.kept_path()
                    local = tuple(nodes[rid].index(n) for n in path)
                    engine.keep_path(rid, drafts[rid], local, next_token)
        return growing

    def _decode_lookahead(self, trees: dict[str, TreeExpansion], kept: set[str]) -> None:
        """Greedy steps below the kept paths until each tree is K + lookahead deep; a request
        is aborted as soon as its tree is (the others, at once)."""
        engine = self.engine
        active = {rid for rid in kept if not trees[rid].is_done}
        for rid in set(trees) - active:
            engine.abort(rid)
        while active and engine.has_unfinished():
            for out in engine.step():
                if out.request_id not in active:
                    continue
                expansion = trees[out.request_id]
                expansion.extend(out.new_token_ids)
                if expansion.is_done or out.finished:  # finished: at the engine's length limit
                    active.discard(out.request_id)
                    engine.abort(out.request_id)
