"""The planner by SLO attainment: which mode and split serves a workload at the highest request
rate within an objective (DistServe's goodput), simulated, and checked against a measured sweep.

``bench serve --slo-sweep`` measures it: per target and rate, the share of requests meeting a
TTFT, TPOT and p99-gap objective (``slo_attainment``), at three scales, and goodput, the highest
rate with >= 90 % attainment. ``sweep`` computes the same figures from simulations: every
candidate (a labelled topology) serves the same workload at every rate (the same lengths and
seeds, only the arrival rate differs, as ``bench serve`` sends them) and the records go through
``slo_attainment.sweep`` unchanged, so the simulated and the measured figures are one
computation apart from where the records come from. ``best`` names, per scale, the candidate
with the highest goodput (ties: the higher attainment summed over the rates, so the one with
more headroom).

``compare_measured`` reads a measured ``slo_sweep.json`` and sets each (label, scale) goodput
the simulation predicts beside the measured one: the ratio, and whether it is within
``TOLERANCE`` (25 %). A goodput is a rate from the swept list, so the check is as coarse as the
list: two neighbouring rates 0.2 apart at 0.8 req/s are 25 % apart. A side with no goodput
(even the lowest rate misses) matches only the other side having none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.slo_attainment import (
    DEFAULT_SCALES,
    DEFAULT_TARGET,
    SloObjective,
    SweepPoint,
    TargetGoodput,
)
from kvmesh.loadgen.slo_attainment import (
    sweep as attainment_sweep,
)
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import SimRequest

TOLERANCE = 0.25


@dataclass(frozen=True, slots=True)
class SloPlan:
    base: SloObjective
    scales: tuple[tuple[str, float], ...]
    rates: tuple[float, ...]
    cores: int
    target: float
    points: tuple[SweepPoint, ...]
    goodputs: tuple[TargetGoodput, ...]
    best: dict[str, TargetGoodput | None]  # by scale; None: no candidate meets it at any rate


def sweep(
    candidates: Mapping[str, Topology],
    cost: CostModel,
    requests_at: Callable[[float], Sequence[SimRequest]],
    rates: Sequence[float],
    base: SloObjective,
    scales: Sequence[tuple[str, float]] = DEFAULT_SCALES,
    cores: int = 1,
    target: float = DEFAULT_TARGET,
) -> SloPlan:
    """Simulate every candidate at every rate (``requests_at(rate)``: the workload sent at that
    rate) and judge the records as ``bench serve --slo-sweep`` judges measured ones."""
    if not candidates:
        raise ValueError("an SLO plan needs at least one candidate topology")
    ordered = tuple(sorted(set(rates)))
    if not ordered or ordered[0] <= 0:
        raise ValueError(f"--slo-sweep needs request rates > 0, got {list(rates)}")
    runs: dict[tuple[str, float], Sequence[RequestRecord]] = {}
    for rate in ordered:
        requests = requests_at(rate)
        for label, topology in candidates.items():
            runs[(label, rate)] = simulate(topology, cost, requests).records
    points, goodputs = attainment_sweep(runs, base, scales, cores, target)
    return SloPlan(
        base,
        tuple(scales),
        ordered,
        cores,
        target,
        tuple(points),
        tuple(goodputs),
        best(points, goodputs, scales),
    )


def best(
    points: Sequence[SweepPoint],
    goodputs: Sequence[TargetGoodput],
    scales: Sequence[tuple[str, float]],
) -> dict[str, TargetGoodput | None]:
    """Per scale, the candidate with the highest goodput; ties go to the higher attainment summed
    over the rates. None where no candidate has a goodput."""
    headroom: dict[tuple[str, str], float] = {}
    for p in points:
        headroom[(p.label, p.scale)] = headroom.get((p.label, p.scale), 0.0) + p.attainment
    out: dict[str, TargetGoodput | None] = {}
    for name, _ in scales:
        ranked = [g for g in goodputs if g.scale == name and g.goodput is not None]
        out[name] = max(
            ranked, key=lambda g: (g.goodput, headroom[(g.label, g.scale)]), default=None
        )
    return out


def format_best(plan: SloPlan) -> list[str]:
    lines = ["planner (SLO attainment): the candidate with the highest goodput at each scale"]
    for name, factor in plan.scales:
        winner = plan.best[name]
        objective = plan.base.scaled(factor)
        limits = objective.describe()
        if winner is None:
            lines.append(
                f"  {name:<8}({limits}): none reaches {plan.target:.0%} even at "
                f"{plan.rates[0]:g} req/s"
            )
        else:
            lines.append(
                f"  {name:<8}({limits}): {winner.label}, {winner.goodput:g} req/s "
                f"({winner.per_core:.3g}/core)"
            )
    return lines


@dataclass(frozen=True, slots=True)
class GoodputCheck:
    label: str
    scale: str
    predicted: float | None
    measured: float | None

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        return self.predicted / self.measured

    @property
    def within(self) -> bool:
        if self.predicted is None or self.measured is None:
            return self.predicted is None and self.measured is None
        ratio = self.ratio
        return ratio is not None and abs(ratio - 1) <= TOLERANCE


def measured_goodputs(body: Mapping) -> dict[tuple[str, str], float | None]:
    """(label, scale) -> goodput of a ``bench serve --slo-sweep`` slo_sweep.json."""
    try:
        return {(g["label"], g["scale"]): g["goodput"] for g in body["goodput"]}
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"not a bench serve slo_sweep.json (no goodput list with label, scale and goodput: "
            f"{exc})"
        ) from None


def measured_setup(body: Mapping) -> tuple[SloObjective, tuple[tuple[str, float], ...], list]:
    """The base objective, scales and swept rates a measured slo_sweep.json was judged by, so
    the simulation judges its runs by the same."""
    try:
        base = SloObjective(**body["base"])
        scales = tuple((name, float(f)) for name, f in body["scales"].items())
        rates = sorted({float(p["rate"]) for p in body["attainment"]})
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(
            f"not a bench serve slo_sweep.json ({exc!r} missing or malformed)"
        ) from None
    return base, scales, rates


def compare_measured(plan: SloPlan, body: Mapping) -> list[GoodputCheck]:
    """Every (label, scale) the measured sweep has and the plan simulated, in the plan's order."""
    measured = measured_goodputs(body)
    return [
        GoodputCheck(g.label, g.scale, g.goodput, measured[(g.label, g.scale)])
        for g in plan.goodputs
        if (g.label, g.scale) in measured
    ]


def format_checks(checks: Sequence[GoodputCheck]) -> str:
    def rate(value: float | None) -> str:
        return "none" if value is None else f"{value:g}"

    width = max([len("target"), *(len(c.label) for c in checks)]) + 2
    lines = [
        f"{'target':<{width}}{'scale':<8}{'simulated':>10}{'measured':>10}{'ratio':>8}  "
        f"within {TOLERANCE:.0%}"
    ]
    for c in checks:
        ratio = "-" if c.ratio is None else f"{c.ratio:.2f}"
        lines.append(
            f"{c.label:<{width}}{c.scale:<8}{rate(c.predicted):>10}{rate(c.measured):>10}{ratio:>8}  "
            f"{'yes' if c.within else 'NO'}"
        )
    return "\n".join(lines)
