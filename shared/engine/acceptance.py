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
from kvmesh.shared.engine.sampler import apply_top_k_top_p, token_seed
from kvmesh.shared.sampling import SamplingOptions


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
) -> list[int]:
    """The token the target picks after each row of ``logits`` (N, V): the argmax when greedy,
    else ``Sampler``'s draw (temperature, top-k/top-p, exponential race). Row ``r`` would be
    output token ``output_indices[r]``; rows with one index share one noise vector. A seeded
    request's noise depends on (seed, index) only; others draw from ``generator``."""
    assert logits.shape[0] == len(output_indices), (logits.shape, len(output_indices))
    if params.is_greedy:
        return logits.argmax(-1).tolist()
    # as Sampler computes it, op for op, so that a seeded draw is the same bits
    x = logits.float().cpu() / torch.tensor([[params.temperature]], dtype=torch.float32)
    if params.top_k > 0 or params.top_p < 1.0:
        n = x.shape[0]
        top_k = torch.full((n,), params.top_k, dtype=torch.int64)
        top_p = torch.full((n,), params.top_p, dtype=torch.float32)
        x = apply_top_k_top_p(x, top_k, top_p)
    probs = x.softmax(-1)
    noise: dict[int, torch.Tensor] = {}
    for index in sorted(set(output_indices)):
        if params.seed is not None:
            g = torch.Generator().manual_seed(token_seed(params.seed, index))
        else:
            g = generator
        noise[index] = torch.empty(probs.shape[1]).exponential_(generator=g)
    q = torch.stack([noise[i] for i in output_indices])
    return probs.div_(q.clamp_(min=1e-20)).argmax(-1).tolist()


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
