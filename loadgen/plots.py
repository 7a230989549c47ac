"""PNG plots of ``kvmesh bench serve`` runs (matplotlib, imported here only when plotting).

Each function takes runs by label ("run", or the mesh mode under --compare) so one figure holds
every mode's curves:

- ``latency_cdfs``: empirical CDFs of TTFT and of every inter-token gap;
- ``token_gaps``: every inter-token gap as a dot at its wall time, one panel per label, with a
  vertical line where each long prompt arrived: a decode step frozen behind a long prefill shows
  as a column of tall dots just right of a line;
- ``goodput_vs_rate``: goodput (or, without an SLO, completed requests per second) at each request
  rate of a sweep.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.loadgen.serve_metrics import RequestRecord, Summary

INSTALL_HINT = (
    "plots need matplotlib: pip install 'kvmesh[bench]' (or pip install 'matplotlib>=3.7'), "
    "or leave out --plot-dir"
)


class PlotError(RuntimeError):
    """Plots asked for but matplotlib is missing."""


def _figure(num_panels: int, *, share_y: bool = False) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(INSTALL_HINT) from None
    # A bare Figure (no pyplot): no global state, no GUI backend; savefig picks Agg for .png.
    fig = Figure(figsize=(6 * num_panels, 4.5), layout="constrained")
    axes = fig.subplots(1, num_panels, sharey=share_y, squeeze=False)[0]
    return fig, list(axes)


def _ecdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    if not values_ms:
        return
    ordered = sorted(values_ms)
    n = len(ordered)
    xs = [ordered[0], *ordered]  # the curve rises from 0 at the smallest value
    ys = [0.0, *((i + 1) / n for i in range(n))]
    ax.step(xs, ys, where="post", label=f"{label} (n={n})")


def latency_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    fig, (ax_ttft, ax_itl) = _figure(2)
    for label, records in runs.items():
        done = [r for r in records if r.is_ok]
        _ecdf(ax_ttft, [r.ttft_s * 1e3 for r in done if r.ttft_s is not None], label)
        _ecdf(ax_itl, [gap * 1e3 for r in done for gap in r.itl_s], label)
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "inter-token gap (ITL)")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="lower right")
    fig.savefig(path, dpi=120)
    return path


def token_gaps(
    runs: Mapping[str, Sequence[RequestRecord]], path: Path, long_prompt_len: int | None
) -> Path:
    """``long_prompt_len``: prompts at least this long get an arrival line (None: none do)."""
    fig, axes = _figure(len(runs), share_y=True)
    for ax, (label, records) in zip(axes, runs.items(), strict=True):
        times = [t for r in records for t in r.chunk_times[1:]]
        gaps = [gap * 1e3 for r in records for gap in r.itl_s]
        ax.scatter(times, gaps, s=4, alpha=0.5, label="inter-token gap")
        if long_prompt_len is not None:
            arrivals = [r.send_s for r in records if r.prompt_len >= long_prompt_len]
            for i, at in enumerate(arrivals):
                ax.axvline(
                    at,
                    color="tab:red",
                    alpha=0.35,
                    linewidth=0.8,
                    label=f"prompt >= {long_prompt_len} tokens sent" if i == 0 else None,
                )
        ax.set_title(f"{label}: token gaps over time")
        ax.set_xlabel("time since start (s)")
        ax.set_ylabel("gap before this chunk (ms)")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="upper right")
    fig.savefig(path, dpi=120)
    return path


def goodput_vs_rate(sweeps: Mapping[str, Sequence[tuple[float, Summary]]], path: Path) -> Path:
    fig, (ax,) = _figure(1)
    rates = sorted({rate for points in sweeps.values() for rate, _ in points})
    position = {rate: i for i, rate in enumerate(rates)}  # categorical: inf has a place too
    has_slo = any(s.goodput is not None for points in sweeps.values() for _, s in points)
    for label, points in sweeps.items():
        points = sorted(points, key=lambda p: p[0])
        xs = [position[rate] for rate, _ in points]
        if has_slo:
            ax.plot(xs, [s.goodput or 0.0 for _, s in points], marker="o", label=f"{label} goodput")
        ax.plot(
            xs,
            [s.request_throughput for _, s in points],
            marker="x",
            linestyle="--",
            label=f"{label} completed req/s",
        )
    ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("requests / s")
    ax.set_title("goodput vs request rate" if has_slo else "throughput vs request rate (no --slo)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left")
    fig.savefig(path, dpi=120)
    return path


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"
