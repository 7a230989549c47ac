"""Fit what the mesh adds to the engine (a device spec's loop, token, request and hand-off
overheads) to a real mesh's probe (pure; ``probe.py`` serves it, ``calibrate.py`` calls both).

Three figures are taken of each mode's probe, the same way from the real records and the
simulated ones (``ProbeFigures``):

- ``ttft_s``: the median TTFT of the isolated requests;
- ``gap_1_s``: the isolated requests' steady gap, the mean gap over the second half of each
  one's tokens, pooled over the requests (the decode loop's period at batch 1);
- ``gap_batch_s``: the same over the batch's requests (the period at batch ``probe.BATCH``).

Mean gaps, not single ones: a client on a busy machine reads several SSE events at once, which
shows as gaps of 0 beside a long one, but leaves their mean alone. Pooled, so that the stalls
below, counted over the same gaps, are part of the same mean.

The simulator replays the probe on the mesh's twin topology (``validate.mesh_topology``) with
the engine's calibrated costs and the overheads so far, and the overheads move by what it
misses, until it reproduces the probe (a few rounds: the terms add up nearly, but not exactly,
once workers share the host's cores):

- ``request_overhead_s``: by the colocated TTFT's miss;
- ``handoff_overhead_s``: by the disaggregated TTFT's miss less the colocated one's;
- ``loop_overhead_s`` and ``token_overhead_s`` (disagg's decode worker) and their
  ``colocated_`` twins: by the line ``miss = loop + token * batch`` through that mode's two gaps
  (at batch 1 and ``BATCH``). Apart, because the same loop and router cost a colocated worker
  more: its threads take every core (one shared pair of terms left colocated gaps 10-18 % short
  and disagg's 11-25 % long on the probe). Without a disagg probe both get colocated's.

A term that comes out negative is set to 0, with a note. The fit reports every figure measured
and simulated with the overheads it found.

The jitter (``Jitter.of``) is measured before the fit, from each mode's isolated requests'
gaps (the second half of each stream): how far their 90th and 99th percentiles and their
largest exceed their own request's median, and how each request's steady gap spreads around
their mean (the pace). The simulator draws every loop step's jitter from its mode's
distribution (a seeded draw) and gives each sequence a pace, which gives its gaps the spread
and tail a real mesh's have; the loop and token terms are then fitted with both in, so the
mean gap still matches. Each mode's
own: measured on both modes' gaps together, the jitter had a p99 excess of 12.4-12.7 ms in two
calibrations, where the disagg mesh's real ITL p99 was 7-9 ms; with that in, the disagg loop
terms came out 0-0.1 ms and the validation's disagg ITL 0.56-0.75x at p50 and 1.34-2.17x at
p99 (docs/sim.md). A colocated worker's threads take every core beside the router and NATS, so
its gaps can stall longer than a disagg decode worker's.

With several probe runs (``--probe-runs N``) each figure is the median of the runs' own
(``ProbeFigures.median``: one disturbed run moves none of them). The jitter is measured on every
run's gaps together: a validation pools its repeats' gaps the same way, so a run slower
throughout than the others widens the spread of paces it measures. (The median of
each run's own percentiles, used before, was short of the pooled tail: on three validations'
real gaps by 0.02-1.0 ms at p99, 0.2-0.4 ms in most.)
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import (
    WARMUP_STEPS,
    CostModel,
    jitter_quantiles,
    pace_quantiles,
    quantile_mean,
    warmup_taper,
)
from kvmesh.sim.probe import BATCH, LONG_INPUT, long_requests, probe_requests
from kvmesh.sim.specs import PACE_KNOT_NAMES, PACE_QUANTILES, DeviceSpec
from kvmesh.sim.topology import Topology

ROUNDS = 8
WARN_RELATIVE_ERROR = 0.25  # a figure the fitted simulator misses by more is reported


class OverheadFitError(ValueError):
    """Probe records the fit cannot use (no colocated probe, failed or too short requests)."""


def _require_served(records: Sequence[RequestRecord]) -> None:
    """Refuse probe records with a failed request (or one without a first token)."""
    bad = [r for r in records if r.error is not None or r.ttft_s is None]
    if bad:
        raise OverheadFitError(f"probe request {bad[0].index} failed: {bad[0].error}")


def median_ttft_s(records: Sequence[RequestRecord]) -> float:
    """The median TTFT of served probe records (``_require_served``)."""
    _require_served(records)
    return statistics.median(r.ttft_s for r in records)  # type: ignore[misc]


def _steady(record: RequestRecord) -> tuple[float, int]:
    """Time and number of gaps of the second half of a request's stream."""
    times = record.chunk_times
    if len(times) < 4:
        raise OverheadFitError(
            f"probe request {record.index} streamed {len(times)} tokens; the fit needs at least 4"
        )
    k = len(times) // 2
    return times[-1] - times[k], len(times) - 1 - k


def steady_gap_s(records: Sequence[RequestRecord]) -> float:
    """Mean gap between the tokens of the second half of each stream, pooled over ``records``."""
    spans = [_steady(r) for r in records]
    return sum(t for t, _ in spans) / sum(n for _, n in spans)


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """One mode's probe in three numbers (seconds)."""

    ttft_s: float
    gap_1_s: float
    gap_batch_s: float

    @classmethod
    def of(cls, isolated: Sequence[RequestRecord], batch: Sequence[RequestRecord]) -> ProbeFigures:
        _require_served([*isolated, *batch])
        if not isolated or not batch:
            raise OverheadFitError("the probe needs isolated requests and a batch")
        return cls(
            statistics.median(r.ttft_s for r in isolated),  # type: ignore[misc]
            steady_gap_s(isolated),
            steady_gap_s(batch),
        )

    @classmethod
    def median(cls, runs: Sequence[ProbeFigures]) -> ProbeFigures:
        """Several probe runs' figures of one mode as one: each figure the median over the runs."""
        if not runs:
            raise OverheadFitError("no probe runs")
        return cls(
            statistics.median(f.ttft_s for f in runs),
            statistics.median(f.gap_1_s for f in runs),
            statistics.median(f.gap_batch_s for f in runs),
        )

    def items(self) -> tuple[tuple[str, float], ...]:
        return (
            ("TTFT", self.ttft_s),
            ("gap at batch 1", self.gap_1_s),
            (f"gap at batch {BATCH}", self.gap_batch_s),
        )


@dataclass(frozen=True, slots=True)
class Jitter:
    """How a loop step's gap varies at batch 1, from request to request and from step to step.

    Step to step: how far a step's gap exceeds its own request's median gap, at the 90th and
    99th percentiles and at most (seconds). Request to request: each request's steady gap (the
    mean of the second half of its stream) against the mean over requests, as the paces at
    ``specs.PACE_QUANTILES`` (0, 0.1, 0.5, 0.9, 1) scaled so that the piecewise-linear
    distribution through them has mean 1 (``DeviceSpec.pace_knots``). Measured against each
    request's own median, the step jitter leaves out what the pace holds: against the common
    median (before), a slow request's every step was jitter."""

    p90_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    pace: tuple[float, ...] = (1.0,) * len(PACE_QUANTILES)

    @property
    def mean_s(self) -> float:
        """The mean of ``CostModel.jitter_s``'s distribution (0 to the median, then linear
        through the 90th and 99th percentiles to the largest)."""
        return quantile_mean(jitter_quantiles(self.p90_s, self.p99_s, self.max_s))

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> Jitter:
        """The jitter of the gaps of the second half of each (batch-1) stream (a stream with
        fewer than 2 such gaps is left out)."""
        halves = [h for r in records if len(h := r.itl_s[len(r.itl_s) // 2 :]) >= 2]
        if not halves:
            return cls()
        excess = [g - statistics.median(h) for h in halves for g in h]
        cuts = statistics.quantiles(excess, n=100, method="inclusive")
        return cls(
            max(0.0, cuts[89]),
            max(0.0, cuts[98]),
            max(0.0, max(excess)),
            pace_knots([sum(h) / len(h) for h in halves]),
        )


def pace_knots(steady_gaps: Sequence[float]) -> tuple[float, ...]:
    """The paces at ``PACE_QUANTILES`` of requests whose steady gaps are ``steady_gaps``: their
    quantiles, over the mean of the piecewise-linear distribution through them (mean 1); all 1
    for fewer than two requests."""
    if len(steady_gaps) < 2 or min(steady_gaps) <= 0:
        return (1.0,) * len(PACE_QUANTILES)
    deciles = statistics.quantiles(steady_gaps, n=10, method="inclusive")
    knots = (min(steady_gaps), deciles[0], deciles[4], deciles[8], max(steady_gaps))
    mean = quantile_mean(pace_quantiles(knots))
    return tuple(x / mean for x in knots)


def mode_jitters(jitters: Mapping[str, Jitter]) -> tuple[Jitter, Jitter]:
    """The (colocated, disagg decode) jitters of a probe's per-mode ``jitters``: a mode the probe
    did not serve takes the other's; neither, none."""
    colocated = jitters.get("colocated", jitters.get("disagg", Jitter()))
    return colocated, jitters.get("disagg", colocated)


@dataclass(frozen=True, slots=True)
class MeshOverheads:
    loop_s: float = 0.0
    token_s: float = 0.0
    colocated_loop_s: float = 0.0
    colocated_token_s: float = 0.0
    request_s: float = 0.0
    handoff_s: float = 0.0
    jitter: Jitter = Jitter()  # the disagg decode worker's
    colocated_jitter: Jitter = Jitter()
    colocated_wake_s: float = 0.0
    prefill_wake_s: float = 0.0
    colocated_warmup_s: float = 0.0
    decode_warmup_s: float = 0.0

    def apply(self, device: DeviceSpec) -> DeviceSpec:
        return dataclasses.replace(
            device,
            loop_overhead_s=self.loop_s,
            token_overhead_s=self.token_s,
            colocated_loop_overhead_s=self.colocated_loop_s,
            colocated_token_overhead_s=self.colocated_token_s,
            request_overhead_s=self.request_s,
            handoff_overhead_s=self.handoff_s,
            jitter_p90_s=self.jitter.p90_s,
            jitter_p99_s=self.jitter.p99_s,
            jitter_max_s=self.jitter.max_s,
            colocated_jitter_p90_s=self.colocated_jitter.p90_s,
            colocated_jitter_p99_s=self.colocated_jitter.p99_s,
            colocated_jitter_max_s=self.colocated_jitter.max_s,
            **_pace_fields("", self.jitter.pace),
            **_pace_fields("colocated_", self.colocated_jitter.pace),
            colocated_wake_s=self.colocated_wake_s,
            prefill_wake_s=self.prefill_wake_s,
            colocated_warmup_s=self.colocated_warmup_s,
            decode_warmup_s=self.decode_warmup_s,
        )


def _pace_fields(prefix: str, pace: Sequence[float]) -> dict[str, float]:
    return {f"{prefix}pace_{k}": x for k, x in zip(PACE_KNOT_NAMES, pace, strict=True)}


@dataclass(frozen=True, slots=True)
class FigureResidual:
    label: str  # "<mode> <figure>"
    measured_s: float
    simulated_s: float

    @property
    def relative(self) -> float:
        return self.simulated_s / self.measured_s - 1 if self.measured_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class OverheadFit:
    overheads: MeshOverheads
    residuals: tuple[FigureResidual, ...]
    notes: tuple[str, ...]
    checks: tuple[FigureResidual, ...] = ()  # figures nothing was fitted to (``check_long``)

    @property
    def max_relative_error(self) -> float:
        return max((abs(r.relative) for r in self.residuals), default=0.0)

    @property
    def max_check_error(self) -> float:
        return max((abs(r.relative) for r in self.checks), default=0.0)


TopologyFor = Callable[[str, CostModel], Topology]


def simulate_probe(cost: CostModel, mode: str, topology_for: TopologyFor) -> ProbeFigures:
    """The probe's figures as the simulator predicts them on ``mode``'s mesh twin."""
    isolated, batch = probe_requests()
    topology = topology_for(mode, cost)
    return ProbeFigures.of(
        simulate(topology, cost, isolated, wake=False).records,
        simulate(topology, cost, batch, wake=False).records,
    )


def check_long(
    cost: CostModel, measured: Mapping[str, Sequence[RequestRecord]], topology_for: TopologyFor
) -> tuple[FigureResidual, ...]:
    """Each mode's median TTFT of the probe's long prompts, measured (``measured``: that mode's
    long-prompt records) and simulated with ``cost`` (the fitted overheads in): a check, since
    nothing was fitted to them."""
    out = []
    for mode, records in measured.items():
        if not records:
            continue
        real = median_ttft_s(records)
        simulated = simulate(topology_for(mode, cost), cost, long_requests(), wake=False).records
        out.append(
            FigureResidual(
                f"{mode} TTFT of a {LONG_INPUT}-token prompt", real, median_ttft_s(simulated)
            )
        )
    return tuple(out)


WAKE_ROLE = {"colocated": "colocated_wake_s", "disagg": "prefill_wake_s"}


def fit_wake(
    cost: CostModel,
    woken: Mapping[str, Sequence[RequestRecord]],
    topology_for: TopologyFor,
    rounds: int = 3,
) -> tuple[MeshOverheads, tuple[FigureResidual, ...]]:
    """The wake terms (a colocated worker's, a prefill worker's) with which the simulator, on
    ``cost`` (the fitted overheads in), reproduces each mode's median TTFT of the probe's long
    prompts sent to an idled mesh (``woken``: that mode's records): their miss moves the term, a
    few rounds (the first chunk's extra shares the host's cores). A mode without such records
    keeps 0. Returns the terms (in a ``MeshOverheads`` of which only they count) and each mode's
    figure, measured and simulated with them."""
    terms = {name: 0.0 for name in WAKE_ROLE.values()}
    measured = {}
    for mode, records in woken.items():
        if records and mode in WAKE_ROLE:
            measured[mode] = median_ttft_s(records)

    def simulated(mode: str) -> float:
        trial = CostModel(cost.model, dataclasses.replace(cost.device, **terms), cost.tp)
        return median_ttft_s(simulate(topology_for(mode, trial), trial, long_requests()).records)

    for _ in range(rounds):
        for mode, real in measured.items():
            name = WAKE_ROLE[mode]
            terms[name] = max(0.0, terms[name] + real - simulated(mode))
    residuals = tuple(
        FigureResidual(
            f"{mode} TTFT of a {LONG_INPUT}-token prompt after idling", real, simulated(mode)
        )
        for mode, real in measured.items()
    )
    fitted = MeshOverheads(
        colocated_wake_s=terms["colocated_wake_s"], prefill_wake_s=terms["prefill_wake_s"]
    )
    return fitted, residuals


WARMUP_ROLE = {"colocated": "colocated_warmup_s", "disagg": "decode_warmup_s"}


def warmup_of(records: Sequence[RequestRecord]) -> float:
    """The warm-up term (``DeviceSpec.decode_warmup_s``) of a mode's long-prompt probe
    requests: how much longer a sequence's first ``WARMUP_STEPS`` gaps after its first token
    are than its steady gap (the mean of the second half of its stream), each the median over
    the requests, fitted by least squares to the taper the simulator charges (the term at the
    first gap, falling linearly to 0 over ``WARMUP_STEPS``). Measured, not replayed: the steady
    figures the other terms are fitted to are the second half of each stream. 0 when the
    requests are too short to tell (fewer than ``2 * WARMUP_STEPS`` gaps) or none is slower."""
    excess: list[list[float]] = [[] for _ in range(WARMUP_STEPS)]
    for r in records:
        gaps = r.itl_s
        if r.error is not None or len(gaps) < 2 * WARMUP_STEPS:
            continue
        span, count = _steady(r)
        base = span / count
        for i in range(WARMUP_STEPS):
            excess[i].append(gaps[i] - base)
    if not excess[0]:
        return 0.0
    weights = [warmup_taper(i) for i in range(WARMUP_STEPS)]  # as the simulator charges it
    medians = [statistics.median(e) for e in excess]
    fitted = sum(w * e for w, e in zip(weights, medians, strict=True)) / sum(w * w for w in weights)
    return max(0.0, fitted)


def fit_warmup(long: Mapping[str, Sequence[RequestRecord]]) -> MeshOverheads:
    """Each mode's warm-up term from its long-prompt probe records (``long``: the back-to-back
    and the woken ones), in a ``MeshOverheads`` of which only they count."""
    terms = {name: 0.0 for name in WARMUP_ROLE.values()}
    for mode, records in long.items():
        if mode in WARMUP_ROLE:
            terms[WARMUP_ROLE[mode]] = warmup_of(records)
    return MeshOverheads(**terms)


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares intercept and slope of ``y = a + b x`` through ``(x, y)`` points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def fit_overheads(
    cost: CostModel,
    measured: Mapping[str, ProbeFigures],
    topology_for: TopologyFor,
    jitters: Mapping[str, Jitter] | None = None,
    rounds: int = ROUNDS,
) -> OverheadFit:
    """The overheads with which the simulator, its loop steps jittering as each mode's
    ``jitters`` say (``mode_jitters``), reproduces ``measured`` (``colocated`` needed, ``disagg``
    optional: without it the hand-off term stays 0). ``cost`` is the engine's."""
    if "colocated" not in measured:
        raise OverheadFitError("the fit needs the colocated mesh's probe")
    modes = [m for m in ("colocated", "disagg") if m in measured]
    colocated_jitter, jitter = mode_jitters(jitters or {})
    o = MeshOverheads(jitter=jitter, colocated_jitter=colocated_jitter)
    for _ in range(rounds):
        trial = CostModel(cost.model, o.apply(cost.device), cost.tp)
        sim = {m: simulate_probe(trial, m, topology_for) for m in modes}
        miss = {m: _minus(measured[m], sim[m]) for m in modes}
        lines = {m: _line([(1.0, miss[m].gap_1_s), (BATCH, miss[m].gap_batch_s)]) for m in modes}
        c_loop, c_token = lines["colocated"]
        d_loop, d_token = lines.get("disagg", (c_loop, c_token))
        d_handoff = miss["disagg"].ttft_s - miss["colocated"].ttft_s if "disagg" in miss else 0.0
        colocated_loop = max(0.0, o.colocated_loop_s + c_loop)
        colocated_token = max(0.0, o.colocated_token_s + c_token)
        o = MeshOverheads(
            loop_s=max(0.0, o.loop_s + d_loop) if "disagg" in miss else colocated_loop,
            token_s=max(0.0, o.token_s + d_token) if "disagg" in miss else colocated_token,
            colocated_loop_s=colocated_loop,
            colocated_token_s=colocated_token,
            request_s=max(0.0, o.request_s + miss["colocated"].ttft_s),
            handoff_s=max(0.0, o.handoff_s + d_handoff),
            jitter=jitter,
            colocated_jitter=colocated_jitter,
        )
    trial = CostModel(cost.model, o.apply(cost.device), cost.tp)
    residuals = []
    for m in modes:
        sim = simulate_probe(trial, m, topology_for)
        for (label, real), (_, predicted) in zip(measured[m].items(), sim.items(), strict=True):
            residuals.append(FigureResidual(f"{m} {label}", real, predicted))
    terms = {
        "colocated_loop_s": o.colocated_loop_s,
        "colocated_token_s": o.colocated_token_s,
        "request_s": o.request_s,
    }
    if "disagg" in measured:
        terms.update(loop_s=o.loop_s, token_s=o.token_s)
    if "disagg" in measured:
        terms["handoff_s"] = o.handoff_s
    notes = tuple(
        f"{name} came out negative and is 0: the engine's costs alone exceed what the mesh showed"
        for name, value in terms.items()
        if value == 0.0
    )
    return OverheadFit(o, tuple(residuals), notes)


def _minus(a: ProbeFigures, b: ProbeFigures) -> ProbeFigures:
    return ProbeFigures(a.ttft_s - b.ttft_s, a.gap_1_s - b.gap_1_s, a.gap_batch_s - b.gap_batch_s)
