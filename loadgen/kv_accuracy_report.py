"""What ``kvmesh model kv-accuracy`` reports (``kv_accuracy.py`` measures it): per KV format and
fixture prompt the greedy tokens agreed before the first difference, the teacher-forced logit
error and top-1 agreement and the reference's margin where the tokens part; per factual
question both answers; and their totals, table and JSON."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PromptAccuracy:
    prompt_tokens: int
    agreed_tokens: int  # greedy tokens equal to the reference's before the first difference
    # teacher-forced (None for the bf16 yardstick: a float pool's prefill attends to the fresh
    # K/V, not to what it stored, so only its greedy decode reads the 16-bit KV)
    top1_agreement: float | None  # fraction of positions whose argmax agrees
    max_logit_error: float | None
    mean_logit_error: float | None
    logit_std: float  # the reference logits' spread over the vocabulary (mean over positions)
    # the reference's top-1 minus top-2 logit where the greedy tokens first differ (None: none)
    flip_gap: float | None = None


@dataclass(frozen=True, slots=True)
class FactAnswer:
    """One factual question's greedy answer (token ids, up to and with the stop token)."""

    prompt_tokens: int
    reference: tuple[int, ...]
    answer: tuple[int, ...]

    @property
    def is_same(self) -> bool:
        return self.answer == self.reference


@dataclass(frozen=True, slots=True)
class KVAccuracyReport:
    model: str
    kv_cache_dtype: str
    max_tokens: int
    prompts: tuple[PromptAccuracy, ...]
    facts: tuple[FactAnswer, ...] = ()

    @property
    def min_agreed_tokens(self) -> int:
        return min(p.agreed_tokens for p in self.prompts)

    @property
    def num_fully_agreed(self) -> int:
        return sum(p.agreed_tokens == self.max_tokens for p in self.prompts)

    @property
    def token_agreement(self) -> float:
        """Share of all generated tokens that came before their prompt's first difference."""
        return sum(p.agreed_tokens for p in self.prompts) / (self.max_tokens * len(self.prompts))

    def _forced(self, name: str) -> list[float] | None:
        """Each prompt's teacher-forced figure ``name``; None for a report without them (the
        bf16 yardstick)."""
        values = [getattr(p, name) for p in self.prompts]
        return None if None in values else values

    @property
    def top1_agreement(self) -> float | None:
        """Teacher-forced: the share of all positions, each fed the reference's tokens before it,
        whose argmax agrees (a flip does not carry over to the tokens after it)."""
        values = self._forced("top1_agreement")
        return None if values is None else sum(values) / len(values)

    @property
    def flip_gaps(self) -> list[float]:
        """The reference's margins at each prompt's first difference, smallest first."""
        return sorted(p.flip_gap for p in self.prompts if p.flip_gap is not None)

    @property
    def num_facts_changed(self) -> int:
        return sum(not f.is_same for f in self.facts)

    @property
    def max_logit_error(self) -> float | None:
        values = self._forced("max_logit_error")
        return None if values is None else max(values)

    @property
    def mean_logit_error(self) -> float | None:
        values = self._forced("mean_logit_error")
        return None if values is None else sum(values) / len(values)

    @property
    def logit_std(self) -> float:
        return sum(p.logit_std for p in self.prompts) / len(self.prompts)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "min_agreed_tokens": self.min_agreed_tokens,
            "num_fully_agreed": self.num_fully_agreed,
            "token_agreement": self.token_agreement,
            "top1_agreement": self.top1_agreement,
            "num_facts_changed": self.num_facts_changed,
            "flip_gaps": self.flip_gaps,
            "max_logit_error": self.max_logit_error,
            "mean_logit_error": self.mean_logit_error,
            "logit_std": self.logit_std,
        }

    def summary(self) -> str:
        facts = (
            f"; factual answers changed: {self.num_facts_changed}/{len(self.facts)}"
            if self.facts
            else ""
        )
        gaps = (
            "; first differences where the reference's top-2 logits are "
            + ", ".join(f"{g:.4f}" for g in self.flip_gaps)
            + " apart"
            if self.flip_gaps
            else ""
        )
        forced = (
            f"; teacher-forced top-1 {self.top1_agreement:.1%}); logit error max "
            f"{self.max_logit_error:.4f}, mean {self.mean_logit_error:.5f}"
            if self.top1_agreement is not None
            and self.max_logit_error is not None
            and self.mean_logit_error is not None
            else "; not teacher-forced: its prefill does not read the KV back)"
        )
        return (
            f"{self.kv_cache_dtype}: {self.token_agreement:.1%} of greedy tokens agree "
            f"({self.num_fully_agreed}/{len(self.prompts)} prompts all {self.max_tokens}, the "
            f"least {self.min_agreed_tokens}{forced} (logit std {self.logit_std:.4f}){gaps}"
            f"{facts}"
        )

    def table(self, decode: Callable[[Sequence[int]], str] | None = None) -> str:
        lines = [
            f"{self.model}: {self.kv_cache_dtype} KV against the model dtype's KV, "
            f"{self.max_tokens} greedy tokens per prompt",
            f"{'prompt':>6} {'tokens':>6} {'agreed':>7} {'top-1':>6} {'max err':>8} "
            f"{'mean err':>9} {'logit std':>9} {'flip gap':>8}",
        ]
        for i, p in enumerate(self.prompts):
            lines.append(
                f"{i:>6} {p.prompt_tokens:>6} {p.agreed_tokens:>7} {_num(p.top1_agreement, 3):>6} "
                f"{_num(p.max_logit_error, 4):>8} {_num(p.mean_logit_error, 5):>9} "
                f"{p.logit_std:>9.4f} "
                f"{'-' if p.flip_gap is None else f'{p.flip_gap:.4f}':>8}"
            )
        for i, f in enumerate(self.facts):
            if not f.is_same and decode is not None:
                lines.append(f"  fact {i} changed: {decode(f.reference)!r} -> {decode(f.answer)!r}")
        lines.append(self.summary())
        return "\n".join(lines)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def agreed_prefix(reference: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of ``tokens`` equal ``reference``'s before the first difference."""
    return next(
        (i for i, (a, b) in enumerate(zip(reference, tokens, strict=True)) if a != b),
        len(reference),
    )
