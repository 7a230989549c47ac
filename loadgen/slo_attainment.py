"""SLO attainment and goodput over a sweep of request rates, as DistServe measures them (pure).

A request *attains* an objective when it completed, its TTFT is within ``ttft_ms``, its TPOT
(mean gap after the first token) within ``tpot_ms``, and the 99th percentile of its own token gaps
within ``gap_p99_ms`` (a stream that freezes once in a hundred gaps passes TPOT but not this).
*Attainment* at a rate is the share of all requests sent (failures count as missed) that attain
it. The objective is given once (the base) and judged at several *scales*: each limit multiplied
by the scale (tight < 1 < loose), since a system's ranking can change with how strict the SLO is.
A limit left out of the base is no limit (``gap_ms=100`` alone judges the token gaps only, the
objective under which disaggregation is meant to pay).

*Goodput* is the highest request rate whose attainment is at least ``target`` (90%), taking the
rates in increasing order and stopping at the first that misses, so one lucky run above a failing
rate does not count; none when the lowest rate already misses. Per core: goodput divided by the
cores the target ran on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord, parse_ms_limits, percentile

DEFAULT_TARGET = 0.9
DEFAULT_SCALES = (("tight", 0.5), ("medium", 1.0), ("loose", 2.0))


LIMITS = ("ttft_ms", "tpot_ms", "gap_p99_ms")


@dataclass(frozen=True, slots=True)
class SloObjective:
    """Limits in milliseconds, every one given checked; ``math.inf`` (or None): no limit."""

    ttft_ms: float = math.inf
    tpot_ms: float = math.inf
    gap_p99_ms: float = math.inf

    def __post_init__(self) -> None:
        for name in LIMITS:
            value = getattr(self, name)
            if value is None:  # as slo_sweep.json writes a limit left out
                object.__setattr__(self, name, math.inf)
            elif not (value > 0 and (math.isfinite(value) or value == math.inf)):
                raise ValueError(f"SLO {name} must be a number of ms > 0, got {value}")
        if all(getattr(self, name) == math.inf for name in LIMITS):
            raise ValueError("an SLO needs at least one of ttft_ms, tpot_ms and gap_ms")

    def describe(self) -> str:
        """``TTFT <= 3000 ms, TPOT <= 50 ms, p99 gap <= 100 ms``, the limits given."""
        words = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "gap_p99_ms": "p99 gap"}
        return ", ".join(
            f"{words[name]} <= {getattr(self, name):g} ms"
            for name in LIMITS
            if getattr(self, name) != math.inf
        )

    def to_json(self) -> dict[str, float | None]:
        """The limits, None where none is set (JSON has no infinity)."""
        return {
            name: None if getattr(self, name) == math.inf else getattr(self, name)
            for name in LIMITS
        }

    @classmethod
    def parse(cls, text: str) -> SloObjective:
        """``"ttft_ms=3000,tpot_ms=50,gap_ms=200"`` (``gap_p99_ms`` = ``gap_ms``); a limit left
        out is no limit, at least one is needed."""
        names = {
            "ttft_ms": "ttft_ms",
            "tpot_ms": "tpot_ms",
            "gap_ms": "gap_p99_ms",
            "gap_p99_ms": "gap_p99_ms",
        }
        values = parse_ms_limits(text, names, "--slo-base")
        for name, value in values.items():
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--slo-base {name}: a limit is a number of ms > 0, got {value:g}")
        if not values:
            raise ValueError("--slo-base needs at least one of ttft_ms, tpot_ms and gap_ms")
        return cls(**values)

    def scaled(self, factor: float) -> SloObjective:
        assert factor > 0
        return SloObjective(self.ttft_ms * factor, self.tpot_ms * factor, self.gap_p99_ms * factor)

    def is_met(self, record: RequestRecord) -> bool:
        ttft = record.ttft_s
        if not record.is_ok or ttft is None or ttft * 1e3 > self.ttft_ms:
            return False
        tpot = record.tpot_s
        if tpot is not None and tpot * 1e3 > self.tpot_ms:
            return False
        gaps = record.itl_s
        return not gaps or percentile(gaps, 99) * 1e3 <= self.gap_p99_ms


def parse_scales(text: str) -> tuple[tuple[str, float], ...]:
    """``"0.5,1,2"`` -> (("tight", 0.5), ("medium", 1.0), ("loose", 2.0)): three increasing
    multiples of the base objective; ``NAME=X`` items name their own."""
    scales = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, raw = part.rpartition("=")
        try:
            factor = float(raw)
        except ValueError:
            raise ValueError(f"--slo-scales {part!r}: {raw!r} is not a number") from None
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"--slo-scales {part!r}: a scale must be > 0")
        scales.append((name if sep else "", factor))
    if len(scales) != 3:
        raise ValueError(f"--slo-scales {text!r}: give three scales (tight, medium, loose)")
    factors = [f for _, f in scales]
    if factors != sorted(set(factors)):
        raise ValueError(f"--slo-scales {text!r}: the scales must increase, tight to loose")
    defaults = [name for name, _ in DEFAULT_SCALES]
    return tuple((name or defaults[i], f) for i, (name, f) in enumerate(scales))


def attainment(records: Sequence[RequestRecord], objective: SloObjective) -> float:
    """Share of ``records`` (all sent, failures included) that attain ``objective``."""
    if not records:
        return 0.0
    return sum(objective.is_met(r) for r in records) / len(records)


def goodput(points: Iterable[tuple[float, float]], target: float = DEFAULT_TARGET) -> float | None:
    """The highest rate of (rate, attainment) points, in increasing rate, up to which every
    rate attains at least ``target``; None when the lowest misses or there are none."""
    best = None
    for rate, share in sorted(points):
        if share < target:
            break
        best = rate
    return best


@dataclass(frozen=True, slots=True)
class SweepPoint:
    label: str
    rate: float
    scale: str
    attainment: float


@dataclass(frozen=True, slots=True)
class TargetGoodput:
    label: str
    scale: str
    goodput: float | None  # req/s
    per_core: float | None  # req/s per core


def sweep(
    runs: Mapping[tuple[str, float], Sequence[RequestRecord]],
    base: SloObjective,
    scales: Sequence[tuple[str, float]] = DEFAULT_SCALES,
    cores: int = 1,
    target: float = DEFAULT_TARGET,
) -> tuple[list[SweepPoint], list[TargetGoodput]]:
    """Attainment of every run (by (label, rate)) at every scale, and every label's goodput per
    scale (in req/s and per core, over ``cores``)."""
    assert cores >= 1
    points = [
        SweepPoint(label, rate, name, attainment(records, base.scaled(factor)))
        for (label, rate), records in runs.items()
        for name, factor in scales
    ]
    labels = list(dict.fromkeys(label for label, _ in runs))
    goodputs = []
    for label in labels:
        for name, _ in scales:
            best = goodput(
                ((p.rate, p.attainment) for p in points if p.label == label and p.scale == name),
                target,
            )
            goodputs.append(
                TargetGoodput(label, name, best, None if best is None else best / cores)
            )
    return points, goodputs


def format_sweep(
    points: Sequence[SweepPoint],
    goodputs: Sequence[TargetGoodput],
    base: SloObjective,
    scales: Sequence[tuple[str, float]],
    target: float = DEFAULT_TARGET,
) -> str:
    """The attainment table (a row per label and rate, a column per scale) and the goodputs."""
    names = [name for name, _ in scales]
    lines = [
        f"SLO attainment ({base.describe()}, times "
        + ", ".join(f"{n} {f:g}" for n, f in scales)
        + ")",
        f"{'target':<20}{'req/s':>8}" + "".join(f"{n:>10}" for n in names),
    ]
    by_key = {(p.label, p.rate, p.scale): p.attainment for p in points}
    rows = list(dict.fromkeys((p.label, p.rate) for p in points))
    for label, rate in rows:
        cells = "".join(f"{by_key[(label, rate, n)]:>10.0%}" for n in names)
        lines.append(f"{label:<20}{rate:>8g}" + cells)
    lines.append(f"goodput (highest rate with >= {target:.0%} attainment), req/s and per core:")
    for g in goodputs:
        value = "none" if g.goodput is None else f"{g.goodput:g} req/s, {g.per_core:.3g}/core"
        lines.append(f"  {g.label:<20}{g.scale:<8}{value}")
    return "\n".join(lines)


def sweep_json(
    points: Sequence[SweepPoint],
    goodputs: Sequence[TargetGoodput],
    base: SloObjective,
    scales: Sequence[tuple[str, float]],
    cores: int,
    target: float = DEFAULT_TARGET,
) -> dict:
    return {
        "base": base.to_json(),
        "scales": {name: factor for name, factor in scales},
        "target_attainment": target,
        "cores": cores,
        "attainment": [
            {"label": p.label, "rate": p.rate, "scale": p.scale, "attainment": p.attainment}
            for p in points
        ],
        "goodput": [
            {"label": g.label, "scale": g.scale, "goodput": g.goodput, "per_core": g.per_core}
            for g in goodputs
        ],
    }
