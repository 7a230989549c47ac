"""Measure this machine as a ``DeviceSpec``: effective FLOP/s, bandwidth, step overhead, link.

Uses the real engine through ``kvmesh bench engine``'s ``KvmeshRunner`` and the real transport
through ``kvmesh bench xfer``'s ``bench_backend`` (torch is imported here, lazily):

- effective FLOP/s: one prompt of ``prompt_len`` tokens prefilled in one step, its FLOPs (the
  cost model's count) over its time (best of ``repeats``);
- bandwidth and step overhead: median decode step at batch 1 over a short context and at
  ``batch`` over ``decode_context`` tokens each; the cost model's bytes of the two steps give the
  slope (bytes/s) and the intercept (the per-step overhead);
- link: the ``shm`` transport's GB/s moving 64 MiB of scattered KV blocks (best of runs).

Efficiencies are 1: the figures are already what the engine achieves. Times are wall-clock (the
simulator predicts wall-clock latency), so a busy machine calibrates slow: run it on a quiet one.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass

from kvmesh.loadgen.sim.cost import CostModel, Slice
from kvmesh.loadgen.sim.specs import DeviceSpec, ModelSpec

_PROBE = DeviceSpec("probe", 1.0, 1.0, 1.0, 1.0)  # only the cost model's counts are used


@dataclass(frozen=True, slots=True)
class Calibration:
    spec: DeviceSpec
    prefill_s: float
    decode_small_s: float
    decode_large_s: float
    link_gbps: float


def _host_memory() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def measure_link_gbps(num_bytes: int = 64 << 20, backend: str = "shm") -> float:
    from kvmesh.loadgen.bench_xfer import Plan
    from kvmesh.loadgen.xfer_backends import bench_backend

    results = bench_backend(backend, [Plan.make(num_bytes, seed=0, runs=4)], 1)
    return max(r.gbps for r in results)


def calibrate(
    model_name: str,
    model: ModelSpec,
    *,
    name: str = "cpu",
    threads: int = 2,
    prompt_len: int = 1024,
    batch: int = 8,
    decode_context: int = 1024,
    decode_tokens: int = 16,
    repeats: int = 3,
) -> Calibration:
    import torch
    from kvmesh.loadgen.bench_engine import KvmeshRunner

    torch.set_num_threads(threads)
    counts = CostModel(model, _PROBE)
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    runner = KvmeshRunner(
        model_name, max(prompt_len, batch * (decode_context + decode_tokens)) + 64
    )
    runner.generate([prompt], 1)  # warm-up
    prefill_s = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.generate([prompt], 1)
        prefill_s = min(prefill_s, time.perf_counter() - t0)
    flops = counts.step_flops([Slice(prompt_len, 0)]) / prefill_s

    def median_step(num: int, context: int) -> float:
        prompts = [[rng.randrange(256) for _ in range(context)] for _ in range(num)]
        runner.decode_step_times(prompts, decode_tokens, time.perf_counter)  # warm-up
        steps: list[float] = []
        for _ in range(repeats):
            steps += runner.decode_step_times(prompts, decode_tokens, time.perf_counter)
        return statistics.median(steps)

    small_ctx = 64
    small_s = median_step(1, small_ctx)
    large_s = median_step(batch, decode_context)
    mid = decode_tokens // 2  # contexts grow during the run; take the middle step's
    small_bytes = counts.step_bytes([Slice(1, small_ctx + mid)])
    large_bytes = counts.step_bytes([Slice(1, decode_context + mid)] * batch)
    if large_s > small_s:
        bandwidth = (large_bytes - small_bytes) / (large_s - small_s)
        overhead = max(0.0, small_s - small_bytes / bandwidth)
    else:  # noise swamped the slope: charge everything to bandwidth
        bandwidth, overhead = large_bytes / large_s, 0.0
    link_gbps = measure_link_gbps()
    spec = DeviceSpec(
        name=name,
        peak_flops=flops,
        mem_bandwidth=bandwidth,
        memory_bytes=_host_memory(),
        link_bandwidth=link_gbps * 1e9,
        step_overhead_s=overhead,
        description=(
            f"calibrated by kvmesh sim --calibrate on {os.cpu_count()} CPUs, {threads} torch "
            f"threads, model {model.name}, {time.strftime('%Y-%m-%d')}: prefill "
            f"{prompt_len} tokens {prefill_s * 1e3:.0f} ms; decode step batch 1 x {small_ctx} "
            f"{small_s * 1e3:.1f} ms, batch {batch} x {decode_context} {large_s * 1e3:.1f} ms; "
            f"shm link {link_gbps:.1f} GB/s"
        ),
    )
    return Calibration(spec, prefill_s, small_s, large_s, link_gbps)
