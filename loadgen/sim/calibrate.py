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
  figures just fitted, reproduces it.

Efficiencies are 1: the figures are already what the engine achieves. Times are wall-clock (the
simulator predicts wall-clock latency), so a busy machine calibrates slow: run it on a quiet one.
The engine part is kept under a minute (48 s for kvmesh-tiny on the loaded 2-core development
box); the mesh probe adds about 40 s (two meshes started, 17 requests each).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.loadgen.sim.engine_scale import EngineScaleFit
from kvmesh.loadgen.sim.fit import DecodePoint, Fit, PrefillPoint, fit_costs
from kvmesh.loadgen.sim.overheads import OverheadFit
from kvmesh.loadgen.sim.specs import DeviceSpec, ModelSpec

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
    from kvmesh.loadgen.bench_xfer import Plan
    from kvmesh.loadgen.xfer_backends import bench_backend

    results = bench_backend(backend, [Plan.make(num_bytes, seed=0, runs=4)], 1)
    return max(r.gbps for r in results)


def chunk_points(runner: Any, prompt: list[int], chunk: int, runs: int) -> list[PrefillPoint]:
    """The best time of each later chunk of ``prompt`` prefilled ``chunk`` tokens a step (the
    engine's step budget lowered to ``chunk`` meanwhile): ``chunk`` tokens after ``chunk``,
    after ``2 * chunk``, ..."""
    from kvmesh.shared.engine.sequence import SamplingParams

    engine = runner.engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
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
    overheads, scaled = probe_mesh(model_name, spec, model, transport) if mesh else (None, None)
    if scaled is not None:
        spec = dataclasses.replace(
            scaled.scale.apply(spec), description=spec.description + "; " + scaled.describe()
        )
    if overheads is not None:
        o = overheads.overheads
        spec = dataclasses.replace(
            overheads.overheads.apply(spec),
            description=spec.description
            + f"; mesh probe: colocated loop {o.colocated_loop_s * 1e3:.2f} ms + "
            f"{o.colocated_token_s * 1e3:.2f} ms per token, decode loop {o.loop_s * 1e3:.2f} ms "
            f"+ {o.token_s * 1e3:.2f} ms per token, "
            f"request {o.request_s * 1e3:.1f} ms, hand-off {o.handoff_s * 1e3:.1f} ms, "
            f"jitter p90 {o.jitter.p90_s * 1e3:.1f} ms, p99 {o.jitter.p99_s * 1e3:.1f} ms, "
            f"max {o.jitter.max_s * 1e3:.1f} ms",
        )
    elapsed = time.perf_counter() - started
    return Calibration(
        spec, fit, tuple(decode), tuple(prefill), link_gbps, elapsed, overheads, scaled
    )


def probe_mesh(
    model_name: str, engine: DeviceSpec, model: ModelSpec, transport: str = "shm"
) -> tuple[OverheadFit, EngineScaleFit | None]:
    """Serve the probe on a real colocated and disagg mesh; fit the engine's slowdown in the
    mesh to its workers' /metrics (None where they could not be read), then the overheads to
    its requests with the scaled engine."""
    from kvmesh.loadgen.sim.cost import CostModel
    from kvmesh.loadgen.sim.engine_scale import (
        PhaseTimings,
        fit_engine_scale,
        simulate_probe_timings,
    )
    from kvmesh.loadgen.sim.overheads import Jitter, ProbeFigures, check_long, fit_overheads
    from kvmesh.loadgen.sim.probe import run_probe
    from kvmesh.loadgen.sim.validate import mesh_topology

    measured, isolated, long, timings = {}, [], {}, {}
    for mode in ("colocated", "disagg"):
        records = run_probe(mode, model_name, transport)
        measured[mode] = ProbeFigures.of(records.isolated, records.batch)
        isolated += records.isolated
        long[mode] = records.long
        if records.short_timings is not None and records.long_timings is not None:
            timings[mode] = PhaseTimings(records.short_timings, records.long_timings)
    scaled, jitter = None, Jitter.of(isolated)
    if timings:
        scaled = fit_engine_scale(
            CostModel(model, engine),
            timings,
            lambda m, c: simulate_probe_timings(m, c, lambda m2, c2: mesh_topology(m2, c2)),
            jitter_mean_s=jitter.mean_s,
        )
        engine = scaled.scale.apply(engine)
    fit = fit_overheads(
        CostModel(model, engine),
        measured,
        lambda m, c: mesh_topology(m, c),
        jitter,
    )
    fitted = CostModel(model, fit.overheads.apply(engine))
    checks = check_long(fitted, long, lambda m, c: mesh_topology(m, c))
    return dataclasses.replace(fit, checks=checks), scaled
