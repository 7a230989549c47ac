"""Token selection.

``Sampler`` turns a batch of logits into one token per row: greedy rows take one argmax over the
batch; the others are scaled by temperature, filtered by top-k / top-p, and drawn with the
exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which needs no cumulative sums. A seeded
request draws its noise from its own ``torch.Generator``, so its tokens do not depend on what else
is in the batch. Whether a token ends its request is ``finish.finish_reason``'s business.
"""

from __future__ import annotations

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
