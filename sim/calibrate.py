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
  each figure's median over the runs (``probe_fit.pool_probe_runs``); each run's figures, and the scale
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.sim.engine_scale import EngineScaleFit
from kvmesh.sim.fit import DecodePoint, Fit, PrefillPoint, fit_costs
from kvmesh.sim.overheads import OverheadFit
from kvmesh.sim.probe_fit import ProbeRun, probe_mesh
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
