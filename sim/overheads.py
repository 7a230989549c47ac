"""Fit what the mesh adds to the engine (a device spec's loop, token, request and hand-off
overheads) to a real mesh's probe (pure; ``probe.py`` serves it, ``probe_figures.py`` reads its
three figures and its jitter, ``calibrate.py`` calls all three).

The simulator replays the probe on the mesh's twin topology (``validate.mesh_topology``) with
the engine's calibrated costs and the overheads so far, its loop steps jittering as each mode's
measured jitter says, and the overheads move by what it misses, until it reproduces the probe's
figures (a few rounds: the terms add up nearly, but not exactly, once workers share the host's
cores):

- ``request_s``: by the colocated TTFT's miss;
- ``handoff_s``: by the disaggregated TTFT's miss less the colocated one's;
- ``loop_s`` and ``token_s`` (disagg's decode worker) and their
  ``colocated_`` twins: by the line ``miss = loop + token * batch`` through that mode's two gaps
  (at batch 1 and ``BATCH``). Apart, because the same loop and router cost a colocated worker
  more: its threads take every core (one shared pair of terms left colocated gaps 10-18 % short
  and disagg's 11-25 % long on the probe). Without a disagg probe both get colocated's.

A term that comes out negative is set to 0, with a note. The fit reports every figure measured
and simulated with the overheads it found. The wake terms (``fit_wake``) and the warm-up terms
(``fit_warmup``) come from the probe's long prompts.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import WARMUP_STEPS, CostModel, warmup_taper
from kvmesh.sim.mesh_terms import MeshOverheads
from kvmesh.sim.probe import BATCH, LONG_INPUT, long_requests, probe_requests
from kvmesh.sim.probe_figures import (
    Jitter,
    OverheadFitError,
    ProbeFigures,
    median_ttft_s,
    mode_jitters,
    steady_span,
)
from kvmesh.sim.topology import Topology

ROUNDS = 8
WARN_RELATIVE_ERROR = 0.25  # a figure the fitted simulator misses by more is reported


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
        device = dataclasses.replace(cost.device.mesh, **terms).apply(cost.device)
        trial = CostModel(cost.model, device, cost.tp)
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
    """The warm-up term (``MeshOverheads.decode_warmup_s``) of a mode's long-prompt probe
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
        span, count = steady_span(r)
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
