"""PNG plots of simulated runs (matplotlib, imported only when plotting).

- ``itl_over_time``: every token gap at its time, one panel per topology
  (``loadgen.plots.token_gaps``, the plot ``kvmesh bench serve`` draws of real runs);
- ``goodput_vs_split``: SLA goodput and bench-serve goodput (TPOT) of every P:D split.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvmesh.loadgen import plots
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.planner import SimCandidate


def itl_over_time(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    return plots.token_gaps(runs, path, None)


def goodput_vs_split(splits: Sequence[SimCandidate], path: Path, title: str) -> Path:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise plots.PlotError(plots.INSTALL_HINT) from None
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    labels = [f"{c.topology.num_prefill}P:{c.topology.num_decode}D" for c in splits]
    xs = range(len(splits))
    ax.plot(
        xs, [c.sla_goodput for c in splits], marker="o", label="SLA goodput (p99 gap per request)"
    )
    ax.plot(
        xs,
        [c.result.summary.goodput or 0.0 for c in splits],
        marker="x",
        linestyle="--",
        label="goodput (TPOT, as bench serve)",
    )
    ax.set_xticks(list(xs), labels)
    ax.set_xlabel("prefill : decode workers")
    ax.set_ylabel("requests / s within the SLA")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.savefig(path, dpi=120)
    return path
