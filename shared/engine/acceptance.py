"""Lossless acceptance of a verified draft tree: which path to keep and the token after it.

Every draft token is its drafter's argmax, so the draft distribution q is one-hot. Speculative
sampling (Leviathan et al. 2023; Chen et al. 2023) with one-hot q accepts draft x with probability
p(x) and, on rejection, samples from p with x removed and renormalised; with several children at
one node (SpecInfer's multi-draft sampling) each is tried in order against the residual the
previous rejections left. That is exactly the law of: draw the target's token y ~ p, then accept
the child whose token is y, if any (y = c1 has probability p(c1); given y != c1, y = c2 has
probability p(c2) / (1 - p(c1)), the renormalised residual; and when every child is rejected y is
distributed as p without them). So acceptance walks the tree comparing each node's children with
the token the target itself picks at that node, drawn as ``Sampler`` draws it, with the noise of
the output index the token will have. Consequences: greedy output is token for token that without
drafts; a seeded request gives the same tokens with or without drafts, whatever they were; an
unseeded one the same distribution. Pure: logits in, token ids out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.grammar import apply_bitmask
from kvmesh.shared.engine.logit_options import RowHistory
from kvmesh.shared.engine.sampler import constrain, draw, token_seed
from kvmesh.shared.text.sampling import SamplingOptions


@dataclass(frozen=True, slots=True)
class Verdict:
    """The accepted path (node indices, root's child first) and the target's token after it."""

    path: tuple[int, ...]
    next_token: int


def target_tokens(
    logits: torch.Tensor,
    params: SamplingOptions,
    output_indices: list[int],
    generator: torch.Generator,
    histories: list[RowHistory] | None = None,
    eos_token_ids: frozenset[int] = frozenset(),
    bitmask: torch.Tensor | None = None,
) -> list[int]:
    """The token the target picks after each row of ``logits`` (N, V), as ``Sampler`` picks
    it: the options that act on logits (over ``histories[r]``, the tokens before row ``r``'s
    token: the sequence and the tree path to the row), then ``draw``. Row ``r`` would be output
    token ``output_indices[r]``; rows with one index share one noise vector. A seeded request's
    noise depends on (seed, index) only; others draw from ``generator``. ``bitmask``: a
    structured output's grammar per row (``grammar.tree_bitmask``)."""
    assert logits.shape[0] == len(output_indices), (logits.shape, len(output_indices))
    rows = [params] * len(output_indices)
    logits = constrain(
        logits,
        rows,
        lambda: histories or [],
        eos_token_ids,
        (lambda x: apply_bitmask(x, bitmask)) if bitmask is not None else None,
    )
    if params.is_greedy:
        return logits.argmax(-1).tolist()
    x = logits.float().cpu()
    noise: dict[int, torch.Tensor] = {}
    for index in sorted(set(output_indices)):
        if params.seed is not None:
            g = torch.Generator().manual_seed(token_seed(params.seed, index))
        else:
            g = generator
        noise[index] = torch.empty(x.shape[1]).exponential_(generator=g)
    q = torch.stack([noise[i] for i in output_indices])
    return draw(x, rows, q)


def tree_histories(
    prompt_ids: list[int], output_ids: list[int], tree: DraftTree
) -> list[RowHistory]:
    """What precedes each verification row's token: the sequence's output (before the tree)
    for row 0, then the path down to node ``j`` for row ``1 + j``."""
    rows = [RowHistory(prompt_ids, output_ids)]
    for j in range(len(tree)):
        path = [tree.tokens[a] for a in tree.path(j)]
        rows.append(RowHistory(prompt_ids, output_ids + path))
    return rows


def accept(tree: DraftTree, picks: list[int]) -> Verdict:
    """Walk from the root: ``picks[0]`` is the target's token after the sequence's last token,
    ``picks[1 + j]`` after node ``j``. Follow the first child whose token is the pick; stop where
    none is. Returns the path taken and the pick at its end (the +1 token)."""
    assert len(picks) == len(tree) + 1, (len(picks), len(tree))
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(tree.parents):
        children.setdefault(parent, []).append(j)
    path: list[int] = []
    node = -1
    while True:
        pick = picks[node + 1]
        nxt = next((c for c in children.get(node, ()) if tree.tokens[c] == pick), None)
        if nxt is None:
            return Verdict(tuple(path), pick)
        path.append(nxt)
        node = nxt
