"""Timing on a device for ``make gpu-check``'s benchmarks: a call's mean time after a warm-up,
the device synchronized around the timed calls (CUDA runs asynchronously)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Seconds per call of ``fn`` on ``device``: one warm-up call, then the mean of ``iters``."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / iters


def ratio(value: float, reference: float) -> float:
    return value / reference if reference > 0 else float("inf")
