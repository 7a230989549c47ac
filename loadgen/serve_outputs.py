"""What ``kvmesh bench serve`` writes after its runs: ``--result-json`` (every figure and
request), ``--plot-dir``'s plots, and ``--slo-sweep``'s attainment table, JSON and plot."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.serve_metrics import RequestRecord, Summary
from kvmesh.loadgen.serve_report import RunResult, rate_text
from kvmesh.loadgen.slo_attainment import SloObjective
from kvmesh.loadgen.workload import WorkloadPrompt


def write_outputs(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], results: list[RunResult]
) -> None:
    if config.result_json is not None:
        import orjson
        from kvmesh.loadgen.serve_report import result_json

        body = result_json(config.to_json(), results)
        config.result_json.parent.mkdir(parents=True, exist_ok=True)
        config.result_json.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        print(f"results: {config.result_json}", file=sys.stderr)
    if config.plot_dir is not None:
        for path in _plot(config, prompts, results):
            print(f"plot: {path}", file=sys.stderr)


def _plot(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], results: list[RunResult]
) -> list[Path]:
    from kvmesh.loadgen import plots

    plot_dir = config.plot_dir
    assert plot_dir is not None
    plot_dir.mkdir(parents=True, exist_ok=True)
    long_len = long_prompt_threshold([p.input_len for p in prompts], config.long_input_len)
    rates = list(dict.fromkeys(r.rate for r in results))
    written = []
    for rate in rates:
        runs = {r.label: r.records for r in results if r.rate == rate}
        suffix = f"_rate-{rate_text(rate).removesuffix(' req/s')}" if len(rates) > 1 else ""
        written.append(plots.latency_cdfs(runs, plot_dir / f"latency_cdf{suffix}.png"))
        written.append(plots.token_gaps(runs, plot_dir / f"token_gaps{suffix}.png", long_len))
        breakdowns = {r.label: r.breakdown for r in results if r.rate == rate and r.breakdown}
        if breakdowns:
            written.append(plots.ttft_stages(breakdowns, plot_dir / f"ttft_stages{suffix}.png"))
    if len(rates) > 1:
        sweeps: dict[str, list[tuple[float, Summary]]] = {}
        for r in results:
            if r.rate is not None:  # a trace has no rate, and is never a sweep
                sweeps.setdefault(r.label, []).append((r.rate, r.summary))
        written.append(plots.goodput_vs_rate(sweeps, plot_dir / "goodput_vs_rate.png"))
    return written


def slo_sweep(config: ServeBenchConfig, results: Sequence[RunResult]) -> None:
    """Print and write (``--slo-dir``) every target's SLO attainment per rate and scale and its
    goodput, also per core."""
    assert config.slo_base is not None
    cores = config.cores or len(config.mesh_cpus) or len(os.sched_getaffinity(0))
    runs = {(r.label, r.rate): r.records for r in results if r.rate is not None}
    write_slo_sweep(runs, config.slo_base, config.slo_scales, cores, config.slo_dir)


def write_slo_sweep(
    runs: Mapping[tuple[str, float], Sequence[RequestRecord]],
    base: SloObjective,
    scales: Sequence[tuple[str, float]],
    cores: int,
    slo_dir: Path,
) -> None:
    """The attainment table printed, slo_sweep.json and (with matplotlib) its plot written."""
    import orjson
    from kvmesh.loadgen import slo_attainment

    points, goodputs = slo_attainment.sweep(runs, base, scales, cores)
    print("\n" + slo_attainment.format_sweep(points, goodputs, base, scales))
    slo_dir.mkdir(parents=True, exist_ok=True)
    path = slo_dir / "slo_sweep.json"
    body = slo_attainment.sweep_json(points, goodputs, base, scales, cores)
    path.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
    print(f"SLO sweep: {path}", file=sys.stderr)
    if importlib.util.find_spec("matplotlib") is not None:
        from kvmesh.loadgen import plots

        plot = plots.slo_attainment(points, goodputs, slo_dir / "slo_attainment.png")
        print(f"plot: {plot}", file=sys.stderr)


def saved_runs(body: Mapping) -> dict[tuple[str, float], list[RequestRecord]]:
    """Every rated run's requests from a ``--result-json`` file, to judge again (``--slo-judge``).
    ValueError, saying what is wrong, for a file that is not one."""
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    runs: dict[tuple[str, float], list[RequestRecord]] = {}
    try:
        for run in body["runs"]:
            rate = run["request_rate"]
            if rate is None:  # a trace replay has no rate to sweep
                continue
            records = [
                RequestRecord(
                    **{
                        k: tuple(v) if k == "chunk_times" else v
                        for k, v in r.items()
                        if k in fields
                    }
                )
                for r in run["requests"]
            ]
            runs[(run["label"], float(rate))] = records
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a bench serve --result-json file (no {exc} in a run)") from None
    if not runs:
        raise ValueError("its runs have no request rate (a trace replay): nothing to sweep")
    return runs


def long_prompt_threshold(input_lens: Sequence[int], long_input_len: int | None) -> int | None:
    """Prompts this long get an arrival line in the gap plot: ``--long-input-len`` when set, else
    twice the median length when some prompt reaches it (a mix of short and long), else none."""
    if long_input_len is not None:
        return long_input_len
    if not input_lens:
        return None
    threshold = math.ceil(2 * statistics.median(input_lens))
    return threshold if max(input_lens) >= threshold else None
