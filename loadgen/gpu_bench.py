"""The benchmarks of ``make gpu-check`` (scripts/gpu_check.py), each against a reference in the
same run, run one after another by ``run_all`` (one that fails does not stop the others):

* ``bench_kv_pack``, ``bench_paged_decode`` and ``bench_quant_matmul`` (``gpu_kernel_bench.py``):
  the KV pack and scatter kernels against a device-to-device copy, paged decode attention
  against SDPA, the quantized matmul against dequantize-then-matmul and the float matmul;
* ``bench_engine_decode`` (``gpu_engine_bench.py``): the engine's decode tokens/s against
  transformers' on the seeded model of realistic shape (``realistic_model.py``).

Every figure comes from timing on ``device`` after a warm-up (Triton compiles on first use).
``DRY_SIZES`` runs the same code on the CPU at tiny sizes (Triton under ``TRITON_INTERPRET=1``):
those figures check the code paths only and say nothing about a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from kvmesh.loadgen.gpu_engine_bench import bench_engine_decode
from kvmesh.loadgen.gpu_kernel_bench import bench_kv_pack, bench_paged_decode, bench_quant_matmul
from kvmesh.loadgen.gpu_sizes import BenchSizes

BENCHMARKS: dict[str, Callable[[BenchSizes, torch.device], dict[str, Any]]] = {
    "kv_pack": bench_kv_pack,
    "paged_decode_attention": bench_paged_decode,
    "quant_matmul": bench_quant_matmul,
    "engine_decode": bench_engine_decode,
}


def run_all(
    sizes: BenchSizes,
    device: torch.device,
    dry_run: bool = False,
    only: list[str] | None = None,
) -> dict[str, Any]:
    """Every benchmark (or those named in ``only``); one that raises is recorded with its error
    and the others still run. ``dry_run``: each result says so and claims no goal (its figures
    are not a GPU's)."""
    results: dict[str, Any] = {}
    for name, bench in BENCHMARKS.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result = bench(sizes, device)
        except Exception as exc:  # a GPU session must see every failure in one run
            result = {"error": f"{type(exc).__name__}: {exc}"}
        result["seconds"] = round(time.perf_counter() - t0, 2)
        if dry_run:
            result["dry_run"] = True
            if "meets_goal" in result:
                result["meets_goal"] = "n/a (dry run)"
        results[name] = result
    return results
