"""The multi-turn chat workload of ``kvmesh bench kv --multi-turn`` and its figures (pure, no I/O).

Many conversations share one system prompt. Turn ``t`` of a conversation sends its whole history
as one token-id prompt: the system prompt, then for every earlier turn its user message and the
model's answer (the exact tokens the server generated), then the turn's new user message. So
from the second turn on, all but the new message (and the last answer token, whose KV no one
computed) could be reused instead of computed.

Turns go in *waves*: turn ``t`` of every conversation is sent (at the arrival offsets of the
load generator's process, ``loadgen/arrivals.py``) only once every conversation has its answer
to turn ``t - 1``. A wave is thus a quiet interval in which the workers' cumulative counters
(``/metrics``) can be read before and after, and the difference is exactly that turn's work.

``TurnCounters`` says what the workers counted in one wave; ``turn_figures`` makes one turn's
(or several turns') figures from the client's records and those counters.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvmesh.loadgen.serve_metrics import RequestRecord, percentile
from kvmesh.loadgen.workload import TokenizerLike, WorkloadPrompt, random_prompts, token_pool

# The workers' counters a wave is measured by (cumulative; a wave's value is after - before).
PREFILL_PROMPT = "kvmesh_prefill_prompt_tokens_total"
PREFILL_PREFIX_HIT = "kvmesh_prefill_prefix_hit_tokens_total"  # own cache + store reads
PREFILL_STORE_HIT = "kvmesh_prefill_store_hit_tokens_total"
DECODE_PREFIX_HIT = "kvmesh_decode_prefix_cache_hit_tokens_total"  # own cache + store reads
# Decode workers that count their local prefills' prompt tokens and store reads themselves (where
# they do not, the client's count of the prompts it sent as local prefills stands in)
DECODE_LOCAL_PROMPT = "kvmesh_decode_local_prompt_tokens_total"
DECODE_STORE_HIT = "kvmesh_decode_store_hit_tokens_total"
DECODE_PREEMPTIONS = "kvmesh_decode_preemptions_total"


@dataclass(frozen=True, slots=True)
class MultiTurnSpec:
    """The workload's sizes: ``conversations`` chats of ``turns`` turns; a shared system prompt
    of ``system_len`` tokens; each user message ``user_len`` tokens, each answer ``answer_len``
    (sent with ``ignore_eos``, so every answer has exactly that many)."""

    conversations: int = 16
    turns: int = 8
    system_len: int = 2048
    user_len: int = 64
    answer_len: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_len", "user_len", "answer_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_prompt_len(self) -> int:
        """The last turn's prompt: the system prompt, every user message, every earlier answer."""
        return self.system_len + self.turns * self.user_len + (self.turns - 1) * self.answer_len


@dataclass(slots=True)
class Conversation:
    """One chat: its user messages (fixed by the seed) and the answers received so far."""

    system: tuple[int, ...]
    user_messages: tuple[tuple[int, ...], ...]
    answer_len: int
    answers: list[tuple[int, ...]] = field(default_factory=list)
    failed_at: int | None = None  # the turn whose request failed: no later turn can be sent

    @property
    def is_alive(self) -> bool:
        return self.failed_at is None

    def prompt(self, turn: int) -> WorkloadPrompt:
        """Turn ``turn``'s request (0-based); needs the answers of every earlier turn."""
        assert len(self.answers) == turn, (
            f"turn {turn} needs {turn} answers, has {len(self.answers)}"
        )
        ids = list(self.system)
        for user, answer in zip(self.user_messages[:turn], self.answers, strict=True):
            ids += user
            ids += answer
        ids += self.user_messages[turn]
        return WorkloadPrompt(tuple(ids), self.answer_len)


def build_conversations(spec: MultiTurnSpec, tokenizer: TokenizerLike) -> list[Conversation]:
    """The same conversations for the same spec (``spec.seed``): random pool tokens."""
    rng = random.Random(f"{spec.seed}:multi-turn")
    pool = token_pool(tokenizer)
    draw = lambda n: random_prompts(tokenizer, [(n, 1)], rng, as_text=False, pool=pool)[0]
    system = draw(spec.system_len).token_ids
    return [
        Conversation(
            system,
            tuple(draw(spec.user_len).token_ids for _ in range(spec.turns)),
            spec.answer_len,
        )
        for _ in range(spec.conversations)
    ]


@dataclass(frozen=True, slots=True)
class TurnCounters:
    """What the workers counted during one wave (differences of cumulative counters, summed over
    the prefill workers and over the decode workers), and what the client knows of where each
    request was prefilled: ``local_requests`` are the requests no prefill worker announced (the
    registry gave them to the decode worker holding their prefix). ``local_prompt_tokens``: their
    prompt tokens, as the decode workers counted them where they do, else as sent."""

    prefill_prompt_tokens: int = 0
    prefill_prefix_hit_tokens: int = 0  # taken from the prefill engine's cache (store reads incl.)
    prefill_store_hit_tokens: int = 0  # of those, read from a kv-store
    local_requests: int = 0
    local_prompt_tokens: int = 0
    decode_prefix_hit_tokens: int = 0
    decode_preemptions: int = 0
    decode_store_hit_tokens: int = 0  # of decode_prefix_hit_tokens, read from a kv-store

    @classmethod
    def between(
        cls,
        before: Mapping[str, Mapping[str, float]],
        after: Mapping[str, Mapping[str, float]],
        *,
        local_requests: int,
        local_prompt_tokens: int,
    ) -> TurnCounters:
        """From two scrapes of every worker (``{service name: {metric: value}}``; prefill workers
        are named ``prefill-*``, decode workers ``decode-*``)."""

        def delta(prefix: str, metric: str) -> int:
            total = 0.0
            for name, samples in after.items():
                if name.startswith(prefix):
                    total += samples.get(metric, 0.0) - before.get(name, {}).get(metric, 0.0)
            return round(total)

        decode_counts_local = any(
            DECODE_LOCAL_PROMPT in samples
            for name, samples in after.items()
            if name.startswith("decode-")
        )
        if decode_counts_local:
            local_prompt_tokens = delta("decode-", DECODE_LOCAL_PROMPT)
        return cls(
            prefill_prompt_tokens=delta("prefill-", PREFILL_PROMPT),
            prefill_prefix_hit_tokens=delta("prefill-", PREFILL_PREFIX_HIT),
            prefill_store_hit_tokens=delta("prefill-", PREFILL_STORE_HIT),
            local_requests=local_requests,
            local_prompt_tokens=local_prompt_tokens,
            decode_prefix_hit_tokens=delta("decode-", DECODE_PREFIX_HIT),
            decode_preemptions=delta("decode-", DECODE_PREEMPTIONS),
            decode_store_hit_tokens=delta("decode-", DECODE_STORE_HIT),
        )

    def __add__(self, other: TurnCounters) -> TurnCounters:
        return TurnCounters(*(getattr(self, f) + getattr(other, f) for f in TurnCounters.__slots__))

    @property
    def prefill_computed_tokens(self) -> int:
        """Prompt tokens the prefill workers computed (not taken from a cache or a store)."""
        return self.prefill_prompt_tokens - self.prefill_prefix_hit_tokens

    @property
    def local_computed_tokens(self) -> int:
        """Prompt tokens the decode workers computed for local prefills."""
        return self.local_prompt_tokens - self.decode_prefix_hit_tokens

    @property
    def computed_tokens(self) -> int:
        return self.prefill_computed_tokens + self.local_computed_tokens


def turn_figures(records: Sequence[RequestRecord], counters: TurnCounters) -> dict[str, Any]:
    """One turn's (or several turns') figures, JSON-ready: client TTFT percentiles over the
    completed requests, and the prefill work the workers counted."""
    ttfts = [r.ttft_s for r in records if r.is_ok and r.ttft_s is not None]
    pct = lambda p: round(percentile(ttfts, p), 4) if ttfts else None
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if not r.is_ok),
        "prompt_tokens": sum(r.prompt_len for r in records),
        "ttft_p50_s": pct(50),
        "ttft_p99_s": pct(99),
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else None,
        "computed_tokens": counters.computed_tokens,
        "prefill": {
            "prompt_tokens": counters.prefill_prompt_tokens,
            "prefix_hit_tokens": counters.prefill_prefix_hit_tokens,
            "store_hit_tokens": counters.prefill_store_hit_tokens,
            "computed_tokens": counters.prefill_computed_tokens,
        },
        "local_prefill": {
            "requests": counters.local_requests,
            "prompt_tokens": counters.local_prompt_tokens,
            "prefix_hit_tokens": counters.decode_prefix_hit_tokens,
            "store_hit_tokens": counters.decode_store_hit_tokens,
            "computed_tokens": counters.local_computed_tokens,
        },
        "decode_preemptions": counters.decode_preemptions,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator`` rounded, or None when either is missing or the divisor is 0."""
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)
