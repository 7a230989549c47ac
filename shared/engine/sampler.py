"""Token selection.

``Sampler`` turns a batch of logits into one token per row. The options that act on logits
(penalties, ``logit_bias``, ``min_tokens``: ``logit_options``) apply first; then ``draw``: greedy
rows take the argmax; the others are scaled by temperature, filtered by min-p, top-k and top-p,
and drawn with the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which needs no
cumulative sums. A seeded request draws its noise from its own ``torch.Generator``, so its tokens
do not depend on what else is in the batch. ``acceptance`` draws verification rows through the
same ``draw``. A structured output's grammar masks what it forbids (``grammar``) before the draw.
``token_logprobs`` gives the chosen tokens' log-probabilities under the model (the
raw logits' log-softmax, before any option, as vLLM's default ``raw_logprobs``). Whether a token
ends its request is ``finish.finish_reason``'s business. ``constrain`` is the preamble that
``Sampler`` and ``acceptance`` share: the options, then the grammar mask, the grammar winning
where the two leave a row no token.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch
from kvmesh.shared.engine.grammar import mask_rows
from kvmesh.shared.engine.logit_options import RowHistory, apply_logit_options
from kvmesh.shared.engine.sequence import Sequence
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs


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


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: (N, V); min_p: (N,), 0 = off. Tokens less likely than ``min_p`` times the
    likeliest go to -inf (the likeliest always survives)."""
    probs = logits.softmax(-1)
    floor = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, float("-inf"))


def constrain(
    logits: torch.Tensor,
    params: Seq[SamplingOptions],
    histories: Callable[[], Seq[RowHistory]],
    eos_token_ids: frozenset[int],
    mask: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The preamble of every draw (``Sampler``, ``acceptance.target_tokens``): ``logits`` (N, V)
    with the options that act on logits applied (``logit_options``, over ``histories()``: what
    precedes each row's token, asked for only when an option needs it), then ``mask``, a
    structured output's grammar (what it forbids goes to -inf). Where the two leave a row no
    token (the options masked all the grammar allows: EOS under min_tokens) the grammar wins: that
    row is the raw logits masked. ``logits`` itself when neither applies."""
    raw = logits
    if any(p.changes_logits for p in params):
        rows = histories()
        assert len(rows) == len(params), (len(rows), len(params))
        logits = apply_logit_options(logits.float().cpu(), params, rows, eos_token_ids)
    if mask is not None:
        logits = mask(logits.float().cpu())
        dead = torch.isneginf(logits).all(-1)
        if dead.any():
            logits[dead] = mask(raw.float().cpu())[dead]
    return logits


def draw(x: torch.Tensor, params: Seq[SamplingOptions], noise: torch.Tensor) -> list[int]:
    """One token per row of ``x`` (N, V) float32 CPU logits, ``logit_options`` applied:
    the argmax for greedy rows, else the exponential race against ``noise`` (N, V) ~ Exp(1)
    after temperature, min-p, top-k and top-p. ``noise`` is consumed."""
    temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
    y = x / temps.unsqueeze(1)
    if any(p.min_p > 0.0 for p in params):
        y = apply_min_p(y, torch.tensor([p.min_p for p in params], dtype=torch.float32))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        y = apply_top_k_top_p(y, top_k, top_p)
    probs = y.softmax(-1)
    sampled = probs.div_(noise.clamp_(min=1e-20)).argmax(-1)
    greedy = torch.tensor([p.is_greedy for p in params])
    if greedy.any():
        sampled = torch.where(greedy, x.argmax(-1), sampled)
    return sampled.tolist()


def token_logprobs(
    logits: torch.Tensor, tokens: Seq[int], num_top: Seq[int]
) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits`` (N, V) chose ``tokens[i]``: its log-probability under the
    model, its rank, and the ``num_top[i]`` likeliest tokens' (ids, log-probabilities,
    likeliest first)."""
    lp = logits.float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1))  # (N, 1)
    ranks = (lp > chosen).sum(-1).add_(1).tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen_l, top_lp_l, top_ids_l = chosen.squeeze(1).tolist(), top_lp.tolist(), top_ids.tolist()
    return [
        TokenLogprobs(chosen_l[i], tuple(top_ids_l[i][:n]), tuple(top_lp_l[i][:n]), ranks[i])
        for i, n in enumerate(num_top)
    ]


class Sampler:
    def __init__(
        self, seed: int | None = None, eos_token_ids: frozenset[int] = frozenset()
    ) -> None:
        # Noise for unseeded requests; seeded ones use their own generator.
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back, besides stop tokens

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: (N, V) float32, one row per sequence. Returns N token ids."""
        assert logits.shape[0] == len(seqs)
        params = [s.params for s in seqs]
        grammars = [s.grammar for s in seqs]
        logits = constrain(
            logits,
            params,
            lambda: [RowHistory(s.prompt_ids, s.output_ids) for s in seqs],
            self.eos_token_ids,
            (lambda x: mask_rows(x, grammars)) if any(g is not None for g in grammars) else None,
        )
        if all(p.is_greedy for p in params):
            return logits.argmax(-1).tolist()
        x = logits.float().cpu()
        q = torch.empty_like(x).exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                # Noise keyed by (seed, output index), not by how many draws came before: the
                # token is the same whichever worker samples it (a prefill worker samples the
                # first, a decode worker the rest) and after a preemption recompute.
                assert seq.seed is not None
                seq.generator.manual_seed(token_seed(seq.seed, seq.num_output_tokens))
                q[i].exponential_(generator=seq.generator)
        return draw(x, params, q)


def token_seed(seed: int, output_index: int) -> int:
    """A 63-bit seed for the noise of one output token of a seeded request (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 29)) >> 1
