"""Plain-text tables of simulated (and measured) runs."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.loadgen.serve_metrics import Stats
from kvmesh.sim.cluster import SimResult
from kvmesh.sim.sla import Sla


def _ms(stats: Stats | None, attr: str) -> str:
    if stats is None:
        return "-"
    value = getattr(stats, attr)
    return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.1f} ms"


def result_row(label: str, result: SimResult, sla: Sla) -> dict[str, str]:
    s = result.summary
    sla_goodput = sla.goodput(result.records, s.duration_s)
    return {
        "topology": label,
        "TTFT p50": _ms(s.ttft, "p50_ms"),
        "TTFT p99": _ms(s.ttft, "p99_ms"),
        "ITL p50": _ms(s.itl, "p50_ms"),
        "ITL p99": _ms(s.itl, "p99_ms"),
        "SLA goodput": f"{sla_goodput:.2f} req/s",
        "goodput (TPOT)": f"{s.goodput or 0.0:.2f} req/s",
        "completed": f"{s.num_completed}/{s.num_requests}",
    }


def format_table(rows: Sequence[dict[str, str]]) -> str:
    """A markdown table (readable as text, pasteable into docs)."""
    if not rows:
        return ""
    headers = list(rows[0])
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row[h] for h in headers) + " |" for row in rows]
    return "\n".join(lines)
