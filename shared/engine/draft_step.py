"""The draft-tree part of a step (``LLMEngine.step(drafts)``): which trees fit their sequences
this step (their nodes appended), each tree's accepted path picked from its verification rows
(``acceptance``) and kept in the sequence with the target's next token, and the step's
``SpecStepStats``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from kvmesh.shared.engine import acceptance, grammar
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.sampler import token_logprobs
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.engine.speculative import DraftVerifier, SpecStepStats, SpecTotals


def trees_for(
    verifier: DraftVerifier, seqs: list[Sequence], drafts: Mapping[str, DraftTree]
) -> dict[int, DraftTree]:
    """Batch index -> tree for the scheduled sequences a draft fits; nodes appended."""
    trees = {}
    for i, seq in enumerate(seqs):
        tree = drafts.get(seq.request_id)
        if tree is not None and verifier.can_verify(seq, tree):
            verifier.append_tree(seq, tree)
            trees[i] = tree
    return trees


def accept_tree(
    verifier: DraftVerifier,
    generator: torch.Generator,
    eos_token_ids: frozenset[int],
    seq: Sequence,
    tree: DraftTree,
    logits: torch.Tensor,
) -> int:
    """Pick the accepted path from the verification logits (K+1, vocab), keep it and the next
    token in the sequence; returns the path's length. ``generator``: the sampler's noise for
    unseeded requests."""
    first = seq.num_output_tokens - len(tree)  # output index of the token after the last one
    indices = [first, *(first + d for d in tree.depths)]
    histories = None
    if seq.params.changes_logits:
        outputs = seq.token_ids[seq.num_prompt_tokens : len(seq) - len(tree)]
        histories = acceptance.tree_histories(seq.prompt_ids, outputs, tree)
    bitmask = None
    if seq.grammar is not None:
        bitmask = grammar.tree_bitmask(seq.grammar, tree, logits.shape[1])
    picks = acceptance.target_tokens(
        logits,
        seq.params,
        indices,
        generator,
        histories,
        eos_token_ids,
        bitmask,
    )
    verdict = acceptance.accept(tree, picks)
    verifier.keep_path(seq, tree, verdict.path, verdict.next_token)
    if seq.grammar is not None:
        for token in [*(tree.tokens[j] for j in verdict.path), verdict.next_token]:
            accepted = seq.grammar.accept_token(token)
            assert accepted, (seq.request_id, token)
    if seq.params.logprobs is not None:  # row of each kept token: its parent's
        kept = [*(tree.tokens[j] for j in verdict.path), verdict.next_token]
        parents = [0, *(1 + j for j in verdict.path)]
        num_top = [seq.params.logprobs] * len(kept)
        seq.logprobs += token_logprobs(logits[parents], kept, num_top)
    return len(verdict.path)


def spec_stats(
    totals: SpecTotals,
    trees: Mapping[int, DraftTree],
    num_accepted: int,
    num_ignored: int,
    t0: float,
) -> SpecStepStats:
    """The step's stats (``t0``: its start, ``time.perf_counter``), added to ``totals``."""
    stats = SpecStepStats(
        num_verified_seqs=len(trees),
        num_ignored_trees=num_ignored,
        num_draft_tokens=sum(len(t) for t in trees.values()),
        num_draft_positions=sum(t.depth for t in trees.values()),
        num_accepted_tokens=num_accepted,
        verify_time_s=time.perf_counter() - t0 if trees else 0.0,
    )
    if trees:
        totals.add(stats)
    else:
        totals.num_ignored_trees += num_ignored
    return stats
