"""Token selection and stop criteria.

``Sampler`` turns a batch of logits into one token per row: greedy rows take one argmax over the
batch; the others are scaled by temperature, filtered by top-k / top-p, and drawn with the
exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which needs no cumulative sums. A seeded
request draws its noise from its own ``torch.Generator``, so its tokens do not depend on what else
is in the batch. ``apply_stop`` decides whether a newly appended token ends the request.
"""

from __future__ import annotations

from typing import Any

import torch
from kvmesh.shared.engine.sequence import Sequence


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """logits: (N, V); top_k: (N,) int64, 0 = off; top_p: (N,) float, 1 = off. Returns (N, V)
    with filtered entries at -inf."""
    V = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1)  # ascending
    k = top_k.masked_fill(top_k <= 0, V).clamp(max=V)
    kth = sorted_logits.gather(1, (V - k).unsqueeze(1))  # (N, 1) smallest kept value
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Noise for unseeded requests; seeded ones use their own generator.
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (N, V) float32, one row per sequence. Returns N token ids."""
        assert logits.shape[0] == len(seqs)
        params = [s.params for s in seqs]
        if all(p.temperature == 0.0 for p in params):
            return logits.argmax(-1).tolist()
        logits = logits.float().cpu()
        temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
        x = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
            top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(-1)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                # Noise keyed by (seed, output index), not by how many draws came before: the
                # token is the same whichever worker samples it (a prefill worker samples the
                # first, a decode worker the rest) and after a preemption recompute.
                seq.generator.manual_seed(token_seed(seq.params.seed, seq.num_output_tokens))
                q[i].exponential_(generator=seq.generator)
        sampled = probs.div_(q.clamp_(min=1e-20)).argmax(-1)
        greedy = torch.tensor([p.temperature == 0.0 for p in params])
        if greedy.any():
            sampled = torch.where(greedy, logits.argmax(-1), sampled)
        return sampled.tolist()


def token_seed(seed: int, output_index: int) -> int:
    """A 63-bit seed for the noise of one output token of a seeded request (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 29)) >> 1


def detokenize_step(tokenizer: Any, seq: Sequence) -> str:
    """Text added by the tokens past ``seq.read_offset`` (vLLM's incremental scheme: decode a short
    window so that merges across token boundaries come out right; hold back half characters)."""
    ids = seq.token_ids
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    new_text = tokenizer.decode(ids[seq.prefix_offset :])
    if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
        return ""
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(ids)
    return new_text[len(prefix_text) :]


def apply_stop(
    seq: Sequence,
    eos_token_ids: frozenset[int],
    max_model_len: int,
    tokenizer: Any | None,
) -> tuple[str | None, str | None]:
    """Check the sequence's last token. Returns ``(finish_reason, text_delta)``.

    A stop string truncates the text just before it, as OpenAI does; while stop strings are set,
    the last ``len(longest stop) - 1`` characters are held back so no part of one is ever streamed.
    Stop tokens add no text. ``text_delta`` is None when the request is not detokenized."""
    p = seq.params
    token = seq.token_ids[-1]
    detok = tokenizer is not None and p.detokenize
    finish = None
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        finish = "stop"
        seq.read_offset = len(seq.token_ids)
    elif detok:
        old_len = len(seq.output_text)
        text = seq.output_text + detokenize_step(tokenizer, seq)
        if p.stop and len(text) > old_len:
            start = max(old_len - max(len(s) for s in p.stop) + 1, 0)
            hits = [i for s in p.stop if (i := text.find(s, start)) >= 0]
            if hits:
                text = text[: min(hits)]
                finish = "stop"
        seq.output_text = text
    if finish is None and (
        seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= max_model_len
    ):
        finish = "length"
    if not detok:
        return finish, None
    end = len(seq.output_text)
    if finish is None and p.stop:
        end = max(end - max(len(s) for s in p.stop) + 1, seq.num_text_emitted)
    delta = seq.output_text[seq.num_text_emitted : end]
    seq.num_text_emitted = end
    return finish, delta
