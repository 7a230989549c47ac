"""PNG plots of ``kvmesh bench serve`` runs (matplotlib, imported here only when plotting).

Each function takes runs by label ("run", or the mesh mode under --compare) so one figure holds
every mode's curves:

- ``latency_cdfs``: empirical CDFs of TTFT and of every inter-token gap;
- ``token_gaps``: every inter-token gap as a dot at its wall time, one panel per label, with a
  vertical line where each long prompt arrived: a decode step frozen behind a long prefill shows
  as a column of tall dots just right of a line;
- ``goodput_vs_rate``: goodput (or, without an SLO, completed requests per second) at each request
  rate of a sweep;
- ``ttft_stages``: the time to first token by stage (``ttft_breakdown``), p50 and p99 bars per
  label, and each role's CPU and runnable-but-waiting time in cores' worth;
- ``slo_attainment``: SLO attainment against the request rate, a panel per SLO scale, a line per
  label, the 90% line and each label's goodput in the legend (``slo_attainment``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.loadgen.serve_metrics import RequestRecord, Summary
from kvmesh.loadgen.slo_attainment import DEFAULT_TARGET, SweepPoint, TargetGoodput
from kvmesh.loadgen.ttft_breakdown import STAGE_LABELS, Breakdown

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


def slo_attainment(
    points: Sequence[SweepPoint],
    goodputs: Sequence[TargetGoodput],
    path: Path,
    target: float = DEFAULT_TARGET,
) -> Path:
    scales = list(dict.fromkeys(p.scale for p in points))
    fig, axes = _figure(len(scales), share_y=True)
    rates = sorted({p.rate for p in points})
    position = {rate: i for i, rate in enumerate(rates)}  # categorical: inf has a place too
    best = {(g.label, g.scale): g.goodput for g in goodputs}
    for ax, scale in zip(axes, scales, strict=True):
        for label in dict.fromkeys(p.label for p in points):
            mine = sorted(
                (p.rate, p.attainment) for p in points if (p.label, p.scale) == (label, scale)
            )
            good = best.get((label, scale))
            text = "none" if good is None else f"{_rate_label(good)} req/s"
            ax.plot(
                [position[r] for r, _ in mine],
                [100 * a for _, a in mine],
                marker="o",
                label=f"{label} (goodput {text})",
            )
        ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
        ax.set_xticks(range(len(rates)), [_rate_label(r) for r in rates])
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_title(f"SLO scale: {scale}")
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left", fontsize="small")
    axes[0].set_ylabel("requests within the SLO (%)")
    fig.savefig(path, dpi=120)
    return path


def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def ttft_stages(breakdowns: Mapping[str, Breakdown], path: Path) -> Path:
    fig, (ax_stages, ax_roles) = _figure(2)
    labels = [label for label, b in breakdowns.items() if b.stages]
    width = 0.8 / max(1, 2 * len(labels))
    keys = list(STAGE_LABELS)
    for i, label in enumerate(labels):
        stages = breakdowns[label].stages
        for j, (pct, hatch) in enumerate((("p50", ""), ("p99", "//"))):
            values = [getattr(stages[k], f"{pct}_ms") / 1e3 if k in stages else 0.0 for k in keys]
            _bars(ax_stages, 2 * i + j, width, values, hatch, f"{label} {pct}")
    _group_ticks(ax_stages, [STAGE_LABELS[k] for k in keys], width)
    ax_stages.set_ylabel("seconds")
    ax_stages.set_title("time to first token by stage")
    roles = sorted({r for b in breakdowns.values() for r in b.roles})
    role_width = 0.8 / max(1, 2 * len(breakdowns))
    for i, (label, b) in enumerate(breakdowns.items()):
        if b.duration_s <= 0:
            continue
        for j, (what, hatch) in enumerate((("cpu_s", ""), ("wait_s", "//"))):
            values = [
                getattr(b.roles[r], what) / b.duration_s if r in b.roles else 0.0 for r in roles
            ]
            name = "CPU" if what == "cpu_s" else "waiting"
            _bars(ax_roles, 2 * i + j, role_width, values, hatch, f"{label} {name}")
    _group_ticks(ax_roles, roles, role_width)
    ax_roles.set_ylabel("cores' worth (seconds / run time)")
    ax_roles.set_title("CPU used and runnable-but-waiting, by role")
    for ax in (ax_stages, ax_roles):
        ax.grid(True, alpha=0.3, axis="y")
        if ax.has_data():
            ax.legend(loc="upper left", fontsize="small")
    fig.savefig(path, dpi=120)
    return path


def _bars(
    ax: Any, slot: int, width: float, values: Sequence[float], hatch: str, label: str
) -> None:
    """Series ``slot`` of a grouped bar chart: a bar ``width`` wide in each group (one group a
    value, 0.8 wide, the series side by side in slot order)."""
    offset = slot * width
    ax.bar([x + offset for x in range(len(values))], values, width, hatch=hatch, label=label)


def _group_ticks(ax: Any, names: Sequence[str], width: float) -> None:
    """Each group's name, slanted, under the middle of its bars (``_bars`` of ``width``)."""
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, rotation=30, ha="right")
