"""The logits rows of one engine step (``LLMEngine.step``): for each scheduled sequence, the tokens
it computes (a verified draft tree's nodes included), the rows it samples from (its last one when
its prompt or its token is complete; one per token when it verifies a tree) and the rows scoring
its prompt (``scoring.num_prompt_rows``); then, from the forward pass's logits, each sequence's
rows and the one row of each sequence sampled plainly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from kvmesh.shared.engine import scoring
from kvmesh.shared.engine.draft_tree import DraftTree
from kvmesh.shared.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class StepRows:
    """Per scheduled sequence, in batch order."""

    num_new: list[int]  # tokens computed (a tree's nodes included)
    num_samples: list[int]  # rows to sample from (or to verify a tree with)
    num_scored: list[int]  # rows scoring prompt tokens, before the sampled ones
    num_logits: list[int]  # rows the forward pass returns: scored + sampled

    def split(
        self, logits: torch.Tensor | None, trees: Mapping[int, DraftTree]
    ) -> tuple[tuple[torch.Tensor, ...], list[int], torch.Tensor | None]:
        """Each sequence's rows of ``logits``, the batch indices of the sequences sampled plainly
        (not verifying a tree) and their rows to sample from, one each, in order."""
        rows = logits.split(self.num_logits) if logits is not None else ()
        plain = [i for i, k in enumerate(self.num_samples) if k and i not in trees]
        if not trees and not any(self.num_scored):
            plain_logits = logits  # one row per sampled sequence, in order
        else:  # verification rows go to acceptance, prompt rows to scoring, the rest sampled
            plain_logits = torch.cat([rows[i][-1:] for i in plain]) if plain else None
        return rows, plain, plain_logits


def step_rows(
    seqs: list[Sequence], num_new_tokens: list[int], trees: Mapping[int, DraftTree]
) -> StepRows:
    """The rows of a step scheduling ``num_new_tokens`` of ``seqs``, ``trees`` (batch index ->
    tree) appended to theirs."""
    num_new = list(num_new_tokens)
    for i, tree in trees.items():
        num_new[i] += len(tree)
    num_samples = [
        int(s.num_computed_tokens + n == len(s)) * (n if i in trees else 1)
        for i, (s, n) in enumerate(zip(seqs, num_new, strict=True))
    ]
    num_scored = [scoring.num_prompt_rows(s, n) for s, n in zip(seqs, num_new, strict=True)]
    num_logits = [a + b for a, b in zip(num_samples, num_scored, strict=True)]
    return StepRows(num_new, num_samples, num_scored, num_logits)
