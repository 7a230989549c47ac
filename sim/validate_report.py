"""What the validation prints and writes (validate.py): the pooled table of real and simulated
percentiles with the sim / real ratios (``format_comparisons``), each real run's own ratios
(``format_runs``), and every request's real and simulated record as JSON (``records_json``).
"""

from __future__ import annotations

import dataclasses

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.real_runs import Steal
from kvmesh.sim.validate_compare import TOLERANCE, Comparison, within


def records_json(comparisons: list[Comparison]) -> str:
    """Every request's real and simulated record (token times included), by mode; each real
    record says which run (0, 1, ...) it came from, and so does each simulated one where every
    run has its own simulation."""
    import json

    def record(r: RequestRecord) -> dict[str, object]:
        return {
            "index": r.index,
            "arrival_s": r.arrival_s,
            "send_s": r.send_s,
            "end_s": r.end_s,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "chunk_times": list(r.chunk_times),
            "error": r.error,
        }

    return json.dumps(
        {
            c.mode: {
                "real": [{**record(r), "run": k} for k, run in enumerate(c.real_runs) for r in run],
                "sim": (
                    [
                        {**record(r), "run": k}
                        for k, sim in enumerate(c.sim_runs)
                        for r in sim.records
                    ]
                    if c.sim_runs
                    else [record(r) for r in c.sim_records]
                ),
                "real_steal": [dataclasses.asdict(steal) for steal in c.steals],
                "real_timings": c.real_timings and dataclasses.asdict(c.real_timings),
                "sim_timings": c.sim_timings and dataclasses.asdict(c.sim_timings),
            }
            for c in comparisons
        },
        indent=1,
    )


def _ratio_cells(values: dict[str, float | None]) -> list[str]:
    return ["-" if r is None else f"{r:.2f}x" for r in values.values()]


def format_comparisons(comparisons: list[Comparison]) -> str:
    """The pooled table: real (every run's records) and simulated percentiles, sim / real, and
    how many ratios are within ``TOLERANCE``."""

    def ms(stats, attr: str) -> str:
        return "-" if stats is None else f"{getattr(stats, attr):.0f}"

    lines = [
        "| mode | | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for name, s in (("real", c.real), ("sim", c.sim)):
            cells = [
                ms(s.ttft, "p50_ms"),
                ms(s.ttft, "p99_ms"),
                ms(s.itl, "p50_ms"),
                ms(s.itl, "p99_ms"),
            ]
            lines.append(f"| {c.mode} | {name} | {' | '.join(cells)} | {s.num_failed} |")
        lines.append(f"| {c.mode} | sim/real | {' | '.join(_ratio_cells(c.ratios()))} | |")
    runs = max((len(c.run_summaries) for c in comparisons), default=1)
    counts = [(c.mode, within(c.ratios()), len(c.ratios())) for c in comparisons]
    pooled_note = f" (the real side pooled over {runs} runs)" if runs > 1 else ""
    if runs > 1 and any(c.sim_runs for c in comparisons):
        pooled_note = f" (both sides pooled over {runs} runs, each simulated with its own fit)"
    elif any(c.fits for c in comparisons):
        real_side = f"the real side pooled over {runs} runs; " if runs > 1 else ""
        pooled_note = f" ({real_side}the simulation fitted to every probe run of the validation)"
    lines.append(
        f"within {TOLERANCE * 100:.0f} %{pooled_note}: "
        + ", ".join(f"{mode} {k}/{n}" for mode, k, n in counts)
        + f": {sum(k for _, k, _ in counts)} of {sum(n for _, _, n in counts)} figures"
    )
    if runs > 1 and not any(c.sim_runs for c in comparisons):
        typical = [(c.mode, c.typical_ratios()) for c in comparisons]
        lines.append(
            "a typical run (each real figure the median over the runs) against the simulation: "
            + "; ".join(f"{mode} {' / '.join(_ratio_cells(r))}" for mode, r in typical)
            + f": {sum(within(r) for _, r in typical)} of {sum(len(r) for _, r in typical)} "
            "figures within"
        )
    return "\n".join(lines)


def format_runs(comparisons: list[Comparison]) -> str:
    """Each real run's own sim / real ratios, and their range per figure: how far the real side
    moves between runs of the same requests."""
    own = any(c.sim_runs for c in comparisons)
    lines = [
        f"each real run against {'its own' if own else 'the'} simulation (sim / real; CPU "
        "steal: the share of the CPU the VM's hypervisor took during the run's probes and its "
        "workload):",
        f"| mode | run | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | within {TOLERANCE * 100:.0f} % | failed "
        "| CPU steal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        per_run = c.run_ratios()
        steals = c.steals or (Steal(),) * len(per_run)
        for k, (values, real, steal) in enumerate(
            zip(per_run, c.run_summaries, steals, strict=True)
        ):
            lines.append(
                f"| {c.mode} | {k + 1} | {' | '.join(_ratio_cells(values))} | "
                f"{within(values)}/{len(values)} | {real.num_failed} | {steal.cell()} |"
            )
        if len(per_run) > 1:
            cells = []
            for key in per_run[0]:
                got = [v[key] for v in per_run if v[key] is not None]
                cells.append(f"{min(got):.2f}-{max(got):.2f}x" if got else "-")
            lines.append(f"| {c.mode} | range | {' | '.join(cells)} | | | |")
    return "\n".join(lines)
