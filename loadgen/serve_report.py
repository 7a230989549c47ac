"""Text and JSON reports of ``kvmesh bench serve`` runs (pure: strings and dicts, no I/O)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.loadgen.compare_targets import sweep_score
from kvmesh.loadgen.serve_metrics import RequestRecord, Stats, Summary
from kvmesh.loadgen.server_breakdown import ServerBreakdown
from kvmesh.loadgen.ttft_breakdown import Breakdown


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: a target (``label``: "run" or a mesh mode) at one request rate (None: the
    arrival times of a trace)."""

    label: str
    rate: float | None
    summary: Summary
    records: tuple[RequestRecord, ...]
    server: ServerBreakdown | None = None  # a kvmesh router's own account of the run
    breakdown: Breakdown | None = None  # per-request stages and per-role CPU (ttft_breakdown)


def rate_text(rate: float | None) -> str:
    """``"4 req/s"``, ``"inf req/s"`` or ``"trace"``."""
    if rate is None:
        return "trace"
    return ("inf" if math.isinf(rate) else f"{rate:g}") + " req/s"


def format_summary(result: RunResult) -> str:
    s = result.summary
    lines = [
        f"==== {result.label} @ {rate_text(result.rate)} ====",
        f"requests: {s.num_completed} completed, {s.num_failed} failed of {s.num_requests}"
        f" in {s.duration_s:.2f} s",
    ]
    if s.failures:
        lines.append("failures: " + ", ".join(f"{k} {v}" for k, v in s.failures.items()))
    if s.num_short:
        lines.append(f"completed with fewer output tokens than asked: {s.num_short}")
    lines += [
        f"input tokens {s.total_input_tokens}, output tokens {s.total_output_tokens}",
        f"request throughput {s.request_throughput:.2f} req/s, output {s.output_throughput:.1f}"
        f" tok/s, total {s.total_token_throughput:.1f} tok/s",
    ]
    if s.goodput is not None:
        lines.append(
            f"goodput {s.goodput:.2f} req/s ({s.num_good}/{s.num_requests} within {_slo_text(s)})"
        )
    lines.append(f"{'':6} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9} {'max':>9}  (ms)")
    for name, stats in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        lines.append(f"{name:6} " + _stats_row(stats))
    return "\n".join(lines)


def _stats_row(stats: Stats | None) -> str:
    if stats is None:
        return " ".join(f"{'-':>9}" for _ in range(5))
    values = (stats.mean_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.max_ms)
    return " ".join(f"{v:9.2f}" for v in values)


def _slo_text(s: Summary) -> str:
    parts = [
        f"{name} <= {value:g} ms"
        for name, value in (("TTFT", s.slo.ttft_ms), ("TPOT", s.slo.tpot_ms), ("E2E", s.slo.e2e_ms))
        if value is not None
    ]
    return ", ".join(parts)


# columns of the comparison table: (header, how to read it off a Summary)
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("p50 TTFT ms", lambda s: s.ttft and s.ttft.p50_ms),
    ("p99 TTFT ms", lambda s: s.ttft and s.ttft.p99_ms),
    ("p50 ITL ms", lambda s: s.itl and s.itl.p50_ms),
    ("p99 ITL ms", lambda s: s.itl and s.itl.p99_ms),
    ("out tok/s", lambda s: s.output_throughput),
    ("goodput r/s", lambda s: s.goodput),
    ("failures", lambda s: s.num_failed),
)


SWEPT = "colocated@"  # labels of --colocated-budgets' runs


def best_colocated(results: Sequence[RunResult], rate: float | None) -> RunResult | None:
    """Of the colocated budget sweep at ``rate``, the best run (compare_targets.sweep_score)."""
    swept = [r for r in results if r.label.startswith(SWEPT) and r.rate == rate]
    if not swept:
        return None
    return max(
        swept,
        key=lambda r: sweep_score(
            r.summary.goodput,
            r.summary.output_throughput,
            r.summary.ttft.p50_ms if r.summary.ttft else None,
        ),
    )


def comparison_text(results: Sequence[RunResult]) -> str:
    """The colocated budget sweep (when there was one), then every target against the best
    colocated run of its rate (or against the first target)."""
    swept = [r for r in results if r.label.startswith(SWEPT)]
    if len(swept) < 2:
        return format_comparison(results)
    rates = list(dict.fromkeys(r.rate for r in results))
    best = [b for rate in rates if (b := best_colocated(results, rate)) is not None]
    text = "colocated token-budget sweep:\n" + format_comparison(swept)
    for b in best:
        text += f"\nbest colocated at {rate_text(b.rate)}: {b.label}"
    chosen = [*best, *(r for r in results if not r.label.startswith(SWEPT))]
    return text + "\n\n" + format_comparison(_as_baseline(chosen))


def _as_baseline(results: list[RunResult]) -> list[RunResult]:
    """The best colocated run of each rate relabelled "colocated (best)", so that every rate's
    rows compare to it even where the best budgets differ."""
    return [
        dataclasses.replace(r, label="colocated (best)") if r.label.startswith(SWEPT) else r
        for r in results
    ]


def format_comparison(results: Sequence[RunResult]) -> str:
    """One row per (rate, label), then per rate the ratio of every other label to the first."""
    labels = list(dict.fromkeys(r.label for r in results))
    rates = list(dict.fromkeys(r.rate for r in results))
    by_key = {(r.label, r.rate): r.summary for r in results}
    width = max(12, *(len(h) + 1 for h, _ in _COLUMNS))
    name_width = max(10, *(len(f"{b}/{labels[0]}") + 1 for b in labels))
    header = f"{'rate':>12} {'mode':<{name_width}}" + "".join(f"{h:>{width}}" for h, _ in _COLUMNS)
    lines = [header]
    for rate in rates:
        for label in labels:
            summary = by_key.get((label, rate))
            if summary is None:
                continue
            cells = "".join(_cell(read(summary), width) for _, read in _COLUMNS)
            lines.append(f"{rate_text(rate):>12} {label:<{name_width}}" + cells)
        base = by_key.get((labels[0], rate))
        for label in labels[1:]:
            other = by_key.get((label, rate))
            if base is None or other is None:
                continue
            cells = "".join(
                _cell(_ratio(read(other), read(base)), width, ratio=True) for _, read in _COLUMNS
            )
            lines.append(f"{'':>12} {f'{label}/{labels[0]}':<{name_width}}" + cells)
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _cell(value: float | int | None, width: int, *, ratio: bool = False) -> str:
    if value is None:
        return f"{'-':>{width}}"
    if ratio:
        return f"{value:>{width - 1}.2f}x"
    if isinstance(value, int):
        return f"{value:>{width}d}"
    return f"{value:>{width}.2f}"


def result_json(config: Mapping[str, Any], results: Sequence[RunResult]) -> dict[str, Any]:
    """Everything a run measured, JSON-ready (an infinite rate is written "inf")."""
    return {
        "config": dict(config),
        "runs": [
            {
                "label": r.label,
                "request_rate": _rate_json(r.rate),
                "summary": dataclasses.asdict(r.summary),
                "server": None if r.server is None else dataclasses.asdict(r.server),
                "ttft_breakdown": None if r.breakdown is None else r.breakdown.to_json(),
                "requests": [_record_json(record) for record in r.records],
            }
            for r in results
        ],
    }


def _rate_json(rate: float | None) -> float | str | None:
    return "inf" if rate is not None and math.isinf(rate) else rate


def _record_json(record: RequestRecord) -> dict[str, Any]:
    return {
        **dataclasses.asdict(record),
        "ttft_s": record.ttft_s,
        "tpot_s": record.tpot_s,
        "e2e_s": record.e2e_s,
    }
