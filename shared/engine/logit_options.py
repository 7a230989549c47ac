"""What a request's sampling options do to its logits before the draw (pure).

Applied in vLLM's order, to the rows whose options change logits (``changes_logits``):

1. ``logit_bias``: the bias is added to the token's logit;
2. ``min_tokens``: while the output is shorter, its stop tokens and EOS (unless ``ignore_eos``)
   are masked (-inf), so nothing but the length limit ends it early;
3. ``repetition_penalty`` r over the tokens of prompt and output: a positive logit is divided by
   r, a negative one multiplied (CTRL's rule, as transformers and vLLM apply it);
4. ``frequency_penalty`` f and ``presence_penalty`` q over the output's tokens: a token seen c
   times loses ``f * c + q``.

Temperature, ``min_p``, top-k and top-p follow in ``sampler.draw``. A row is the choice of one
token after a given history (``RowHistory``): the next token of a sequence, or, when a draft tree
is verified, the token after one of its nodes, whose history is the sequence plus the path to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvmesh.shared.text.sampling import SamplingOptions


@dataclass(frozen=True, slots=True)
class RowHistory:
    """The tokens before a row's token: the prompt, and the output so far."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


def apply_logit_options(
    logits: torch.Tensor,
    params: Sequence[SamplingOptions],
    histories: Sequence[RowHistory],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """logits: (N, V) float32 on the CPU, one row per (params, history); returns a new (N, V)
    with each row's options applied (rows without such options are copied unchanged)."""
    assert logits.shape[0] == len(params) == len(histories), (logits.shape, len(params))
    out = logits.clone()
    V = out.shape[1]
    for i, (p, h) in enumerate(zip(params, histories, strict=True)):
        if not p.changes_logits:
            continue
        row = out[i]
        if p.logit_bias:
            ids = torch.tensor([t for t in p.logit_bias if t < V], dtype=torch.int64)
            bias = torch.tensor([b for t, b in p.logit_bias.items() if t < V])
            row.index_add_(0, ids, bias.to(row.dtype))
        if len(h.output_ids) < p.min_tokens:
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            if ends:
                row[torch.tensor([t for t in ends if t < V], dtype=torch.int64)] = float("-inf")
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(h.prompt_ids) | set(h.output_ids)), dtype=torch.int64)
            if seen.numel():
                x = row[seen]
                row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and h.output_ids:
            counts = torch.bincount(torch.tensor(h.output_ids, dtype=torch.int64), minlength=V)
            counts = counts[:V].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out
