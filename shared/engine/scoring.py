"""What the engine reports about probabilities (pure): the sampled tokens' logprobs and the
prompt's (``SamplingOptions.logprobs`` and ``.prompt_logprobs``), from the rows of a step."""

from __future__ import annotations

import torch
from kvmesh.shared.engine.sampler import token_logprobs
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import TokenLogprobs


def sampled_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> dict[int, TokenLogprobs]:
    """id(seq) -> the sampled token's logprobs, for the sequences whose options ask for them."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not want:
        return {}
    rows = logits[torch.tensor(want, device=logits.device)] if len(want) < len(seqs) else logits
    num_top = [seqs[i].params.logprobs or 0 for i in want]
    lps = token_logprobs(rows, [tokens[i] for i in want], num_top)
    return {id(seqs[i]): lp for i, lp in zip(want, lps, strict=True)}


def num_prompt_rows(seq: Sequence, num_new: int) -> int:
    """Rows of this step's chunk that score prompt tokens (``SamplingOptions.prompt_logprobs``):
    row ``j`` of a chunk from position ``c`` gives the log-probabilities of prompt token
    ``c + j + 1``, up to the prompt's last token (its row samples the first output token)."""
    if seq.params.prompt_logprobs is None or seq.is_scored:
        return 0
    # after a preemption the prompt is computed again: only the tokens not scored yet
    first = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
    return max(0, min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens - 1) - first)


def score_prompt(seq: Sequence, rows: torch.Tensor) -> None:
    """Prompt log-probabilities from ``rows`` (k, V): of the prompt tokens after those scored."""
    start = len(seq.prompt_logprobs)
    targets = seq.token_ids[start + 1 : start + 1 + rows.shape[0]]
    num_top = [seq.params.prompt_logprobs or 0] * len(targets)
    seq.prompt_logprobs += token_logprobs(rows, targets, num_top)
