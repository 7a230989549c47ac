"""Prompt-length distributions of a serving workload (pure: a ``random.Random`` in, lengths out).

``uniform`` is ``workload.LengthSpec`` (over [low, high]). ``normal`` and ``lognormal`` take the
mean and standard deviation *of the lengths* (for the log-normal, sigma² = ln(1 + sd²/mean²) and
mu = ln(mean) - sigma²/2 of the underlying normal) and clip each draw to [low, high]: clipped,
not redrawn, as load testers do, so a tail piles up at the bounds and the mean moves toward them.
The high bound is further cut to what the model's context leaves for the output
(``fit_context``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Literal

from kvmesh.loadgen.workload import LengthSpec, WorkloadError

LengthKind = Literal["uniform", "normal", "lognormal"]
LENGTH_KINDS: tuple[LengthKind, ...] = ("uniform", "normal", "lognormal")


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Lengths drawn from ``kind`` (``mean``/``sd`` for normal and log-normal), clipped to
    [low, high]; ``uniform`` draws uniformly over [low, high] and ignores ``mean``/``sd``."""

    kind: LengthKind
    low: int
    high: int
    mean: float = 0.0
    sd: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise WorkloadError(f"length distribution must be one of {', '.join(LENGTH_KINDS)}")
        if not 1 <= self.low <= self.high:
            raise WorkloadError(f"length bounds must satisfy 1 <= min <= max, got {self}")
        if self.kind != "uniform":
            if not (math.isfinite(self.mean) and self.mean > 0):
                raise WorkloadError(f"a {self.kind} length needs a mean > 0, got {self.mean}")
            if not (math.isfinite(self.sd) and self.sd >= 0):
                raise WorkloadError(f"a {self.kind} length needs an sd >= 0, got {self.sd}")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            return LengthSpec(self.low, self.high).sample(rng)
        if self.kind == "normal":
            value = rng.gauss(self.mean, self.sd)
        else:
            sigma2 = math.log1p((self.sd / self.mean) ** 2)
            value = rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))
        return min(self.high, max(self.low, round(value)))

    def fit_context(self, max_model_len: int, output_len: int) -> LengthDistribution:
        """The same distribution with ``high`` cut so that a prompt and ``output_len`` tokens fit
        ``max_model_len``; a WorkloadError when not even ``low`` does."""
        room = max_model_len - output_len
        if room < self.low:
            raise WorkloadError(
                f"prompts of at least {self.low} tokens and {output_len} output tokens do not fit "
                f"the model's context of {max_model_len}; lower --input-len-range's minimum or "
                "--output-len"
            )
        return replace(self, high=min(self.high, room))

    @classmethod
    def parse(
        cls, kind: str, length: int, spread: str | None = None, sd: float | None = None
    ) -> LengthDistribution:
        """From the flags: ``uniform`` is ``LengthSpec.parse(length, spread)``; ``normal`` and
        ``lognormal`` have mean ``length``, ``sd`` and bounds ``spread`` = "MIN:MAX" (default:
        1 to mean + 6 sd, which clips a normal draw's upper tail almost never)."""
        if kind == "uniform":
            if sd is not None:
                raise WorkloadError("--input-len-sd applies to normal and lognormal lengths")
            spec = LengthSpec.parse(length, spread)
            return cls("uniform", spec.low, spec.high)
        if sd is None:
            raise WorkloadError(f"a {kind} prompt length needs --input-len-sd")
        if spread is None or not spread.strip():
            low, high = 1, max(1, math.ceil(length + 6 * sd))
        else:
            low_text, sep, high_text = spread.partition(":")
            try:
                if not sep:
                    raise ValueError
                low, high = int(low_text), int(high_text)
            except ValueError:
                raise WorkloadError(
                    f"--input-len-range {spread!r}: a {kind} length is clipped to MIN:MAX"
                ) from None
        return cls(kind, low, high, float(length), float(sd))  # type: ignore[arg-type]
