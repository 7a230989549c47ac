"""The mesh probe's runs as ``kvmesh sim --calibrate`` fits them (calibrate.py's last part):
each run's figures (``ProbeRun``), several runs pooled into medians (``PooledProbe``), then the
engine's slowdown in the mesh's workers and the mesh's overheads fitted to them (``fit_probe``;
``validate`` refits its runs with it too).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.engine_scale import EngineScale, EngineScaleFit, PhaseTimings, median_phases
from kvmesh.sim.mesh_terms import Jitter, MeshOverheads
from kvmesh.sim.overheads import (
    OverheadFit,
    ProbeFigures,
    mode_jitters,
)
from kvmesh.sim.probe import ProbeRecords
from kvmesh.sim.probe_figures import jitter_of
from kvmesh.sim.specs import DeviceSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """One run of the mesh probe (one mesh of each mode): its figures, and the engine scale and
    overheads fitted to it alone (printed to show the spread between runs; the spec gets the
    fit to the runs' medians)."""

    figures: dict[str, ProbeFigures]  # by mode
    jitter: dict[str, Jitter]  # by mode
    long_ttft_s: dict[str, float]  # by mode: the median TTFT of its long prompts
    timings: dict[str, PhaseTimings]  # by mode; a mode whose /metrics were unread is absent
    scale: EngineScale | None = None
    overheads: MeshOverheads | None = None


@dataclass(frozen=True, slots=True)
class PooledProbe:
    """Several probe runs as the fit takes them: each figure and engine mean the median over
    the runs; the jitter of every run's batch-1 gaps together (``jitter_of`` their union: a
    validation pools its runs' gaps, so how far the runs differ is part of the tail it
    measures); the long prompts' records of every run (the check's median TTFT is over all of
    them)."""

    figures: dict[str, ProbeFigures]
    jitter: dict[str, Jitter]  # by mode
    long: dict[str, tuple[RequestRecord, ...]]
    timings: dict[str, PhaseTimings]
    woken: dict[str, tuple[RequestRecord, ...]] = dataclasses.field(default_factory=dict)


def probe_run(records: Mapping[str, ProbeRecords]) -> ProbeRun:
    """One probe run's figures (``records``: that run's probe of each mode)."""
    figures = {mode: ProbeFigures.of(r.isolated, r.batch) for mode, r in records.items()}
    jitter = {mode: jitter_of(r.isolated) for mode, r in records.items()}
    long = {
        mode: statistics.median(x.ttft_s for x in r.long if x.ttft_s is not None)
        for mode, r in records.items()
        if any(x.ttft_s is not None for x in r.long)
    }
    timings = {
        mode: PhaseTimings(r.short_timings, r.long_timings)
        for mode, r in records.items()
        if r.short_timings is not None and r.long_timings is not None
    }
    return ProbeRun(figures, jitter, long, timings)


def pool_probe_runs(runs: Sequence[Mapping[str, ProbeRecords]]) -> PooledProbe:
    """The runs' figures as one (one run: its own figures, as before)."""
    if not runs:
        raise ValueError("no probe runs")
    each = [probe_run(r) for r in runs]
    modes = [m for m in ("colocated", "disagg") if any(m in r for r in runs)]
    return PooledProbe(
        {m: ProbeFigures.median([r.figures[m] for r in each if m in r.figures]) for m in modes},
        {m: jitter_of([x for r in runs if m in r for x in r[m].isolated]) for m in modes},
        {m: tuple(x for r in runs if m in r for x in r[m].long) for m in modes},
        {
            m: median_phases([r.timings[m] for r in each if m in r.timings])
            for m in modes
            if any(m in r.timings for r in each)
        },
        {m: tuple(x for r in runs if m in r for x in r[m].woken) for m in modes},
    )


def probe_mesh(
    model_name: str, engine: DeviceSpec, model: ModelSpec, transport: str = "shm", runs: int = 1
) -> tuple[OverheadFit, EngineScaleFit | None, tuple[ProbeRun, ...]]:
    """Serve the probe ``runs`` times on a real colocated and disagg mesh (the modes in turn);
    fit the engine's slowdown in the mesh to its workers' /metrics (None where they could not
    be read), then the overheads to its requests with the scaled engine, to the runs' medians.
    With several runs, each run's figures and its own fits come back too (else ``()``)."""
    from kvmesh.sim.probe import run_probe

    if runs < 1:
        raise ValueError(f"--probe-runs must be at least 1, got {runs}")
    served = [
        {mode: run_probe(mode, model_name, transport) for mode in ("colocated", "disagg")}
        for _ in range(runs)
    ]
    pooled = pool_probe_runs(served)
    overheads, scaled = fit_probe(engine, model, pooled)
    each: tuple[ProbeRun, ...] = ()
    if runs > 1:
        each = tuple(_fitted_run(engine, model, r) for r in served)
    return overheads, scaled, each


def _fitted_run(engine: DeviceSpec, model: ModelSpec, run: Mapping[str, ProbeRecords]) -> ProbeRun:
    """One run's figures, with the scale and overheads fitted to that run alone."""
    one = probe_run(run)
    overheads, scaled = fit_probe(engine, model, pool_probe_runs([run]), checks=False)
    return dataclasses.replace(
        one,
        scale=None if scaled is None else scaled.scale,
        overheads=overheads.overheads,
    )


def fit_probe(
    engine: DeviceSpec, model: ModelSpec, probe: PooledProbe, checks: bool = True
) -> tuple[OverheadFit, EngineScaleFit | None]:
    """The engine scale (where the probe has /metrics), then the overheads with it, fitted to
    ``probe``'s figures; with ``checks``, the long prompts' TTFT checked on the result."""
    from kvmesh.sim.cost import CostModel
    from kvmesh.sim.engine_scale import fit_engine_scale, simulate_probe_timings
    from kvmesh.sim.overheads import check_long, fit_overheads, fit_wake, fit_warmup
    from kvmesh.sim.validate import mesh_topology

    scaled = None
    colocated_jitter, jitter = mode_jitters(probe.jitter)
    if probe.timings:
        scaled = fit_engine_scale(
            CostModel(model, engine),
            probe.timings,
            lambda m, c: simulate_probe_timings(m, c, lambda m2, c2: mesh_topology(m2, c2)),
            jitter_mean_s={"colocated": colocated_jitter.mean_s, "decode": jitter.mean_s},
        )
        engine = scaled.scale.apply(engine)
    fit = fit_overheads(
        CostModel(model, engine),
        probe.figures,
        lambda m, c: mesh_topology(m, c),
        probe.jitter,
    )
    wake, woken = fit_wake(
        CostModel(model, fit.overheads.apply(engine)),
        probe.woken,
        lambda m, c: mesh_topology(m, c),
    )
    warmup = fit_warmup(
        {mode: (*probe.long.get(mode, ()), *probe.woken.get(mode, ())) for mode in probe.figures}
    )
    fit = dataclasses.replace(
        fit,
        overheads=dataclasses.replace(
            fit.overheads,
            colocated_wake_s=wake.colocated_wake_s,
            prefill_wake_s=wake.prefill_wake_s,
            colocated_warmup_s=warmup.colocated_warmup_s,
            decode_warmup_s=warmup.decode_warmup_s,
        ),
        residuals=fit.residuals + woken,
    )
    if not checks:
        return fit, scaled
    fitted = CostModel(model, fit.overheads.apply(engine))
    return dataclasses.replace(
        fit, checks=check_long(fitted, probe.long, lambda m, c: mesh_topology(m, c))
    ), scaled
