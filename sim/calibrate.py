"""Measure this machine as a ``DeviceSpec``: step costs fitted to several measured points, link.

Uses the real engine through ``kvmesh bench engine``'s ``KvmeshRunner`` and the real transport
through ``kvmesh bench xfer``'s ``bench_backend`` (torch is imported here, lazily):

- prefill: one whole prompt of each of ``prefill_lens`` tokens in one step, and the later
  chunks of a prompt prefilled ``chunk_tokens`` at a time as the mesh does (``chunk_tokens``
  new tokens after ``chunk_tokens``, then after twice that), each the best of ``repeats`` + 1;
- decode: the median step of ``decode_tokens`` steps at each batch of ``batches`` over each of
  ``contexts`` tokens (the contexts grow during the run: the middle step's is used);
- ``fit.fit_costs`` turns those into effective FLOP/s, bandwidth and the per-step, per-sequence
  and per-chunk overheads, with each point's residual, or refuses an implausible fit;
- link: the ``shm`` transport's GB/s moving 64 MiB of scattered KV blocks (best of runs);
- the last-level cache from sysfs (``lscpu`` where sysfs lacks it), the cores this process may
  run on, and the torch threads the measurement used;
- then what the mesh adds (``mesh=True``): a real local mesh of each mode serves the small probe
  workload (``probe.py``, not the validation workload), and ``overheads.fit_overheads`` finds the
  loop, per-token, per-request and hand-off overheads with which the simulator, on the engine
  figures just fitted, reproduces it. With ``probe_runs`` N > 1 the probe is served N times per
  mode (fresh meshes, the modes in turn) and the engine scale and overheads are fitted once, to
  each figure's median over the runs (``pool_probe_runs``); each run's figures, and the scale
  and overheads fitted to that run alone, are kept (``ProbeRun``) to show the spread.

Efficiencies are 1: the figures are already what the engine achieves. Times are wall-clock (the
simulator predicts wall-clock latency), so a busy machine calibrates slow: run it on a quiet one.
The engine part is kept under a minute (48 s for kvmesh-tiny on the loaded 2-core development
box); the mesh probe adds about 15-40 s a run (two meshes started, 20 requests each).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.engine_scale import EngineScale, EngineScaleFit, PhaseTimings, median_phases
from kvmesh.sim.fit import DecodePoint, Fit, PrefillPoint, fit_costs
from kvmesh.sim.overheads import (
    Jitter,
    MeshOverheads,
    OverheadFit,
    ProbeFigures,
    mode_jitters,
)
from kvmesh.sim.probe import ProbeRecords
from kvmesh.sim.specs import DeviceSpec, ModelSpec

_SIZE = re.compile(r"^\s*([\d.]+)\s*([KMG]?)(i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True, slots=True)
class Calibration:
    spec: DeviceSpec
    fit: Fit
    decode: tuple[DecodePoint, ...]
    prefill: tuple[PrefillPoint, ...]
    link_gbps: float
    seconds: float  # how long the measurement took
    mesh: OverheadFit | None = None  # None: the mesh was not probed (engine figures only)
    # the engine's slowdown in the mesh's workers; None: not probed, or /metrics unread
    engine_scale: EngineScaleFit | None = None
    probe_runs: tuple[ProbeRun, ...] = ()  # each probe run apart (several runs only)


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
    the runs; the jitter of every run's batch-1 gaps together (``Jitter.of`` their union: a
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
    jitter = {mode: Jitter.of(r.isolated) for mode, r in records.items()}
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
        {m: Jitter.of([x for r in runs if m in r for x in r[m].isolated]) for m in modes},
        {m: tuple(x for r in runs if m in r for x in r[m].long) for m in modes},
        {
            m: median_phases([r.timings[m] for r in each if m in r.timings])
            for m in modes
            if any(m in r.timings for r in each)
        },
        {m: tuple(x for r in runs if m in r for x in r[m].woken) for m in modes},
    )


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def parse_size(text: str) -> int | None:
    """``32768K``, ``32 MiB``, ``512K`` (sysfs, lscpu) in bytes; None if it is not a size."""
    m = _SIZE.match(text.split("(")[0])
    if not m:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def last_level_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The largest data or unified cache of cpu0, from sysfs, else from ``lscpu``; 0 if neither
    says (then every step is charged its weights)."""
    best = 0
    for index in sorted(cpu_dir.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = parse_size((index / "size").read_text())
        except OSError:
            continue
        if kind in ("Data", "Unified") and size:
            best = max(best, size)
    if best:
        return best
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("L3 cache", "L2 cache") and (size := parse_size(value)):
            best = max(best, size)
    return best


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def measure_link_gbps(num_bytes: int = 64 << 20, backend: str = "shm") -> float:
    from kvmesh.loadgen.bench_xfer import XferPlan
    from kvmesh.loadgen.xfer_backends import bench_backend

    results = bench_backend(backend, [XferPlan.make(num_bytes, seed=0, runs=4)], 1)
    return max(r.gbps for r in results)


def chunk_points(runner: Any, prompt: list[int], chunk: int, runs: int) -> list[PrefillPoint]:
    """The best time of each later chunk of ``prompt`` prefilled ``chunk`` tokens a step (the
    engine's step budget lowered to ``chunk`` meanwhile): ``chunk`` tokens after ``chunk``,
    after ``2 * chunk``, ..."""
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = runner.engine
    params = SamplingOptions(max_tokens=1, temperature=0, ignore_eos=True)
    saved = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = chunk
    best: list[float] = []
    try:
        for run in range(runs):
            engine.add_request(f"chunks-{run}", prompt, params)
            times = []
            while engine.has_unfinished():
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            best = [min(a, b) for a, b in zip(best, times, strict=True)] if best else times
    finally:
        engine.scheduler.max_num_batched_tokens = saved
    return [PrefillPoint(chunk, t, context=i * chunk) for i, t in enumerate(best) if i > 0]


def calibrate(
    model_name: str,
    model: ModelSpec,
    *,
    name: str = "cpu",
    threads: int = 2,
    prefill_lens: Sequence[int] = (128, 512, 1024),
    batches: Sequence[int] = (1, 4, 16),
    contexts: Sequence[int] = (64, 512),
    decode_tokens: int = 16,
    repeats: int = 2,
    chunk_tokens: int = 512,
    mesh: bool = True,
    transport: str = "shm",
    probe_runs: int = 1,
) -> Calibration:
    """Measure, fit and return the spec; raises ``fit.FitError`` on an implausible fit and
    ``overheads.OverheadFitError`` on a probe that failed."""
    import torch
    from kvmesh.loadgen.bench_engine import KvmeshRunner

    started = time.perf_counter()
    torch.set_num_threads(threads)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]
    in_flight = max(max(prefill_lens), max(batches) * (max(contexts) + decode_tokens)) + 64
    runner = KvmeshRunner(model_name, in_flight)
    runner.generate([tokens(max(prefill_lens))], 2)  # warm-up: first prefill and decode steps

    prefill = []
    for n in prefill_lens:
        prompt, best = tokens(n), float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            runner.generate([prompt], 1)
            best = min(best, time.perf_counter() - t0)
        prefill.append(PrefillPoint(n, best))
    prefill += chunk_points(runner, tokens(3 * chunk_tokens), chunk_tokens, repeats + 1)

    decode = []
    mid = decode_tokens // 2  # contexts grow during the run; take the middle step's
    for context in contexts:
        for batch in batches:
            prompts = [tokens(context) for _ in range(batch)]
            steps: list[float] = []
            for _ in range(repeats):
                steps += runner.decode_step_times(prompts, decode_tokens, time.perf_counter)
            decode.append(DecodePoint(batch, context + mid, statistics.median(steps)))

    cache = last_level_cache_bytes()
    fit = fit_costs(model, cache, decode, prefill)
    del runner  # its KV pool and threads; the meshes below are child processes
    link_gbps = measure_link_gbps()
    cores = available_cores()
    spec = DeviceSpec(
        name=name,
        peak_flops=fit.flops,
        mem_bandwidth=fit.bandwidth,
        memory_bytes=_host_memory(),
        link_bandwidth=link_gbps * 1e9,
        step_overhead_s=fit.step_overhead_s,
        seq_overhead_s=fit.seq_overhead_s,
        chunk_overhead_s=fit.chunk_overhead_s,
        cache_bytes=float(cache),
        attention_flops=fit.attention_flops,
        attention_bandwidth=fit.attention_bandwidth,
        cores=cores,
        calibration_threads=threads,
        description=(
            f"calibrated by kvmesh sim --calibrate on {cores} CPUs ({cache >> 20} MiB LLC), "
            f"{threads} torch threads, model {model.name}, {time.strftime('%Y-%m-%d')}: "
            + "; ".join(
                f"{r.label} {r.measured_s * 1e3:.1f} ms (fit {r.relative:+.0%})"
                for r in fit.residuals
            )
            + f"; shm link {link_gbps:.1f} GB/s"
        ),
    )
    overheads, scaled, runs = (
        probe_mesh(model_name, spec, model, transport, probe_runs) if mesh else (None, None, ())
    )
    if scaled is not None:
        spec = dataclasses.replace(
            scaled.scale.apply(spec), description=spec.description + "; " + scaled.describe()
        )
    if overheads is not None:
        o = overheads.overheads
        spec = dataclasses.replace(
            overheads.overheads.apply(spec),
            description=spec.description + f"; mesh probe ({'median of ' if len(runs) > 1 else ''}"
            f"{max(len(runs), 1)} run{'s' if len(runs) > 1 else ''}): "
            f"colocated loop {o.colocated_loop_s * 1e3:.2f} ms + "
            f"{o.colocated_token_s * 1e3:.2f} ms per token, decode loop {o.loop_s * 1e3:.2f} ms "
            f"+ {o.token_s * 1e3:.2f} ms per token, "
            f"request {o.request_s * 1e3:.1f} ms, hand-off {o.handoff_s * 1e3:.1f} ms, "
            f"wake colocated {o.colocated_wake_s * 1e3:.1f} ms, prefill "
            f"{o.prefill_wake_s * 1e3:.1f} ms, warm-up colocated "
            f"{o.colocated_warmup_s * 1e3:.2f} ms, decode {o.decode_warmup_s * 1e3:.2f} ms, "
            + "; ".join(
                f"{who} jitter p90 {j.p90_s * 1e3:.1f} ms, p99 {j.p99_s * 1e3:.1f} ms, "
                f"max {j.max_s * 1e3:.1f} ms, pace p10-p90 {j.pace[1]:.2f}-{j.pace[3]:.2f}"
                for who, j in (("colocated", o.colocated_jitter), ("decode", o.jitter))
            ),
        )
    elapsed = time.perf_counter() - started
    return Calibration(
        spec, fit, tuple(decode), tuple(prefill), link_gbps, elapsed, overheads, scaled, runs
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
