"""``kvmesh sim``: simulate a kvmesh cluster on a workload, plan its prefill:decode split,
calibrate this machine as a device spec, or check the simulator against the real mesh.

- default: run one topology (``--mode``, ``--prefill``, ``--decode``, ``--chunk-tokens``) and
  print its row;
- ``--plan``: colocated continuous batching, colocated with chunked prefill, and the planner's
  disaggregated split on ``--gpus``, with the planner's reasons (``--plot-dir``: PNGs);
- ``--calibrate``: measure this machine with the real engine and transport, then what a real
  local mesh adds to the engine (a small probe workload, not the validation's), write a device
  spec;
- ``--validate``: the same workload simulated and served by a local mesh (colocated and disagg),
  sim/real ratios of p50/p99 TTFT and ITL (``--probe-each-run``: each mesh serves the probe
  before and after its workload; the simulation is fitted to the median of all those probe
  runs, and, printed apart, each repeat to its own).

Torch is imported by ``--calibrate`` and ``--validate`` only.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from kvmesh.loadgen.arrivals import ARRIVAL_KINDS
from kvmesh.loadgen.sim.specs import SPEC_DIR

DEFAULT_CPU_SPEC = SPEC_DIR / "devices" / "cpu.json"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "sim",
        help="cluster simulator: TTFT/ITL/goodput of a topology, P:D planner, calibration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = p.add_mutually_exclusive_group()
    action.add_argument("--plan", action="store_true", help="search the P:D split (and chunk)")
    action.add_argument("--calibrate", action="store_true", help="measure this machine")
    action.add_argument("--validate", action="store_true", help="sim vs the real local mesh")

    hw = p.add_argument_group("hardware and model")
    hw.add_argument("--model", default="llama-3-8b", help="model spec name or JSON file")
    hw.add_argument("--device", default="h100", help="device spec name or JSON file")
    hw.add_argument("--gpus", type=int, default=8, help="GPU budget of --plan")
    hw.add_argument("--tp", type=int, default=1, help="devices per worker (tensor parallel)")

    topo = p.add_argument_group("topology (without --plan)")
    topo.add_argument("--mode", choices=("colocated", "disagg"), default="disagg")
    topo.add_argument("--prefill", type=int, default=4, help="prefill workers (disagg)")
    topo.add_argument("--decode", type=int, default=4, help="decode (or colocated) workers")
    topo.add_argument(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="prefill chunk (disagg) or step token budget (colocated); 0: colocated without chunking",
    )
    topo.add_argument("--max-num-seqs", type=int, default=256)
    topo.add_argument("--decode-pacing-ms", type=float, default=0.0)
    topo.add_argument("--kv-capacity-tokens", type=int, help="KV pool per worker (default: memory)")

    load = p.add_argument_group("workload")
    load.add_argument("--num-requests", type=int, default=300)
    load.add_argument("--request-rate", type=float, default=3.0, help="req/s")
    load.add_argument("--arrival", choices=ARRIVAL_KINDS, default="gamma")
    load.add_argument("--burstiness", type=float, default=0.5, help="gamma shape (< 1: bursty)")
    load.add_argument("--input-len-range", default="8192:32768", help="MIN:MAX prompt tokens")
    load.add_argument("--output-len-range", default="512:512", help="MIN:MAX output tokens")
    load.add_argument("--trace", type=Path, help="JSONL trace instead of the synthetic workload")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--sla", default="ttft_ms=1500,itl_ms=30", help="p99 TTFT and ITL limits")

    out = p.add_argument_group("output")
    out.add_argument("--plot-dir", type=Path, help="--plan: write sim_*.png here")
    out.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"--calibrate: spec file (default {DEFAULT_CPU_SPEC})",
    )
    out.add_argument(
        "--real-model",
        default="kvmesh-tiny",
        help="--calibrate/--validate: the checkpoint the engine runs (kvmesh-tiny or a directory "
        "from `kvmesh model seeded`); --model must be its spec",
    )
    out.add_argument("--threads", type=int, default=2, help="--calibrate: torch threads")
    out.add_argument(
        "--no-mesh-probe",
        dest="mesh_probe",
        action="store_false",
        help="--calibrate: the engine and link only; leave the mesh's overheads at 0",
    )
    out.add_argument(
        "--probe-runs",
        type=int,
        default=3,
        help="--calibrate: serve the mesh probe this many times per mode (fresh meshes, the "
        "modes in turn) and fit the engine scales and overheads to each figure's median over "
        "the runs; each run's figures are printed",
    )
    out.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="--validate: serve the workload through this many fresh meshes per mode and "
        "compare the simulation with their records pooled (percentiles over repeats x "
        "requests); each run's own ratios are printed too",
    )
    out.add_argument(
        "--probe-each-run",
        action="store_true",
        help="--validate: fit the engine scale and mesh overheads to the probe served on each "
        "validation mesh before and after its workload, on the --device spec's engine figures "
        "(the spec's own scale and overheads are not used): to the median of all those probe "
        "runs, and, printed apart, each repeat to its own two",
    )
    out.add_argument(
        "--max-steal",
        type=float,
        default=2.0,
        metavar="PCT",
        help="--validate: a repeat whose probes or workload lost more than PCT %% of the CPU to "
        "the VM's hypervisor (steal in /proc/stat) is served again (both modes), at most --redo "
        "times; its runs are set aside and printed. A negative value turns this off",
    )
    out.add_argument(
        "--redo",
        type=int,
        default=2,
        help="--validate: how many disturbed repeats may be served again (--max-steal)",
    )
    out.add_argument(
        "--prefill-nice",
        type=int,
        default=0,
        help="--validate: the disagg mesh's prefill niceness (kvmesh up --prefill-nice), "
        "mirrored in the simulated host",
    )
    out.add_argument(
        "--per-request",
        action="store_true",
        help="--validate: also each request's TTFT and mean gap, real and simulated, and the "
        "engines' mean step, chunk and queue wait from the mesh's /metrics and the simulation",
    )
    out.add_argument(
        "--records-out",
        type=Path,
        help="--validate: write every request's real and simulated token times here (JSON)",
    )
    out.add_argument("--transport", default="shm", choices=("auto", "shm", "tcp"))
    p.set_defaults(func=run)


def _fail(message: str) -> int:
    print(f"kvmesh sim: {message}", file=sys.stderr)
    return 2


def _sla(text: str) -> Any:
    from kvmesh.loadgen.sim.sla import Sla

    values = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = part.partition("=")
        if key not in ("ttft_ms", "itl_ms"):
            raise ValueError(f"--sla {part!r}: expected ttft_ms=MS,itl_ms=MS")
        values[key] = float(raw)
    if set(values) != {"ttft_ms", "itl_ms"}:
        raise ValueError("--sla needs both ttft_ms and itl_ms")
    return Sla(**values)


def _requests(args: argparse.Namespace) -> list[Any]:
    from kvmesh.loadgen.arrivals import ArrivalProcess
    from kvmesh.loadgen.sim import workload
    from kvmesh.loadgen.workload import LengthSpec

    if args.trace is not None:
        return workload.from_trace(args.trace, args.num_requests)
    return workload.synthetic(
        ArrivalProcess(args.arrival, args.request_rate, args.burstiness),
        args.num_requests,
        LengthSpec.parse(0, args.input_len_range),
        LengthSpec.parse(0, args.output_len_range),
        args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from kvmesh.loadgen.arrivals import TraceError
    from kvmesh.loadgen.sim.cost import CostModel
    from kvmesh.loadgen.sim.specs import SpecError, load_device, load_model
    from kvmesh.loadgen.workload import WorkloadError

    try:
        model = load_model(args.model)
        if args.calibrate:
            return _calibrate(args, model)
        device = load_device(args.device)
        cost = CostModel(model, device, args.tp)
        sla = _sla(args.sla)
        requests = _requests(args)
        if args.validate:
            return _validate(args, cost, requests)
        if args.plan:
            return _plan(args, cost, requests, sla)
        return _one(args, cost, requests, sla)
    except (SpecError, TraceError, WorkloadError, ValueError) as exc:
        return _fail(str(exc))


def _topology(args: argparse.Namespace, **overrides: Any) -> Any:
    from kvmesh.loadgen.sim.topology import Topology

    fields = dict(
        mode=args.mode,
        num_decode=args.decode,
        num_prefill=args.prefill if args.mode == "disagg" else 0,
        chunk_tokens=args.chunk_tokens or None,
        max_num_seqs=args.max_num_seqs,
        tp=args.tp,
        decode_pacing_s=args.decode_pacing_ms / 1e3,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    fields.update(overrides)
    return Topology(**fields)


def _assumptions(cost: Any, requests: list[Any], sla: Any) -> str:
    d, m = cost.device, cost.model
    n_in = [r.input_len for r in requests]
    return (
        f"{m.name} ({m.weight_bytes / 1e9:.1f} GB weights, {m.kv_bytes_per_token / 1024:.0f} KiB KV "
        f"per token) on {d.name} x tp {cost.tp}: {d.peak_flops / 1e12:.0f} TFLOP/s x "
        f"{d.flops_efficiency:g}, {d.mem_bandwidth / 1e12:.2f} TB/s x {d.bandwidth_efficiency:g}, "
        f"{d.step_overhead_s * 1e3:g} ms per step, {d.cache_bytes / 1e6:g} MB cache, link {d.link_bandwidth / 1e9:g} GB/s; "
        f"{len(requests)} requests, prompts {min(n_in)}-{max(n_in)} tokens; "
        f"SLA p99 TTFT <= {sla.ttft_ms:g} ms, p99 ITL <= {sla.itl_ms:g} ms"
    )


def _one(args: argparse.Namespace, cost: Any, requests: list[Any], sla: Any) -> int:
    from kvmesh.loadgen.sim.cluster import simulate
    from kvmesh.loadgen.sim.report import format_table, result_row

    topology = _topology(args)
    result = simulate(topology, cost, requests, sla.slo)
    print(_assumptions(cost, requests, sla))
    print(format_table([result_row(topology.label, result, sla)]))
    return 0


def _plan(args: argparse.Namespace, cost: Any, requests: list[Any], sla: Any) -> int:
    from kvmesh.loadgen.sim import planner
    from kvmesh.loadgen.sim.cluster import simulate
    from kvmesh.loadgen.sim.report import format_table, result_row

    workers = args.gpus // args.tp
    chunk = args.chunk_tokens or 2048
    colocated = [
        _topology(args, mode="colocated", num_prefill=0, num_decode=workers, chunk_tokens=None),
        _topology(args, mode="colocated", num_prefill=0, num_decode=workers, chunk_tokens=chunk),
    ]
    baselines = [(t, simulate(t, cost, requests, sla.slo)) for t in colocated]
    base = _topology(args, mode="disagg", num_prefill=1, num_decode=1, chunk_tokens=chunk)
    plan = planner.plan(cost, requests, sla, args.gpus, base=base)
    rows = [result_row(t.label, r, sla) for t, r in baselines]
    rows.append(result_row(f"planner: {plan.best.topology.label}", plan.best.result, sla))
    print(_assumptions(cost, requests, sla))
    print(format_table(rows))
    print()
    print("\n".join(planner.explain(plan)))
    print()
    print("every split at chunk", chunk)
    print(format_table([result_row(c.topology.label, c.result, sla) for c in plan.splits]))
    if args.plot_dir is not None:
        from kvmesh.loadgen.sim import plots

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        runs = {t.label: r.records for t, r in baselines}
        runs[plan.best.topology.label] = plan.best.result.records
        title = f"{cost.model.name} on {args.gpus} x {cost.device.name}: goodput by split"
        for path in (
            plots.itl_over_time(runs, args.plot_dir / "sim_itl_over_time.png"),
            plots.goodput_vs_split(plan.splits, args.plot_dir / "sim_goodput_vs_split.png", title),
        ):
            print(f"plot: {path}", file=sys.stderr)
    return 0


def _calibrate(args: argparse.Namespace, model: Any) -> int:
    from kvmesh.loadgen.sim.calibrate import calibrate
    from kvmesh.loadgen.sim.fit import FitError
    from kvmesh.loadgen.sim.overheads import OverheadFitError
    from kvmesh.loadgen.sim.specs import write_device

    if args.probe_runs < 1:
        return _fail(f"--probe-runs must be at least 1, got {args.probe_runs}")
    try:
        result = calibrate(
            args.real_model,
            model,
            threads=args.threads,
            mesh=args.mesh_probe,
            transport="shm" if args.transport == "auto" else args.transport,
            probe_runs=args.probe_runs,
        )
    except FitError as exc:
        return _fail(f"calibration refused: {exc}")
    except OverheadFitError as exc:
        return _fail(f"mesh probe refused: {exc}")
    s, fit = result.spec, result.fit
    print(f"measured in {result.seconds:.0f} s on {s.cores} cores, {s.calibration_threads} threads")
    print("| point | measured ms | fitted ms | residual |\n|---|---|---|---|")
    for r in fit.residuals:
        print(
            f"| {r.label} | {r.measured_s * 1e3:.2f} | {r.predicted_s * 1e3:.2f} | "
            f"{r.relative:+.1%} |"
        )
    for note in fit.notes:
        print(f"note: {note}")
    if fit.max_relative_error > 0.25:
        print(
            f"warning: a point is off by {fit.max_relative_error:.0%}: the cost model does not "
            "describe this machine well at that shape (or the machine was busy)"
        )
    cache = "in" if s.cache_bytes >= model.weight_bytes else "out of"
    print(
        f"effective {s.peak_flops / 1e9:.1f} GFLOP/s, {s.mem_bandwidth / 1e9:.2f} GB/s; overhead "
        f"{s.step_overhead_s * 1e3:.2f} ms per step + {s.seq_overhead_s * 1e3:.3f} ms per "
        f"sequence + {s.chunk_overhead_s * 1e3:.2f} ms per prefill chunk; "
        f"{s.cache_bytes / 2**20:.0f} MiB LLC ({model.name}'s weights {cache} it); "
        f"link {s.link_bandwidth / 1e9:.1f} GB/s"
    )
    if result.probe_runs:
        _print_probe_runs(result.probe_runs)
    if result.engine_scale is not None:
        _print_engine_scale(result.engine_scale)
    elif result.mesh is not None:
        print("\nmesh engine scale: not measured (the mesh's /metrics could not be read); 1")
    if result.mesh is not None:
        _print_mesh_fit(result.mesh)
    print(f"wrote {write_device(s, args.out or DEFAULT_CPU_SPEC)}")
    return 0


def _print_probe_runs(runs: Any) -> None:
    """Each probe run's figures and the scale and overheads fitted to it alone: the spread that
    the fit to the medians (below) smooths."""
    from kvmesh.loadgen.sim.engine_scale import role_means

    n = len(runs)
    print(f"\nmesh probe, {n} runs (the fit below is to each figure's median over them):")
    print(
        "| run | mode | TTFT ms | gap batch 1 ms | gap batch 8 ms | long-prompt TTFT ms | "
        "engine mean ms (count) |\n|---|---|---|---|---|---|---|"
    )
    for k, r in enumerate(runs, 1):
        for mode, f in r.figures.items():
            means = role_means(mode, r.timings[mode]) if mode in r.timings else {}
            engine = ", ".join(f"{role} {m * 1e3:.2f} ({c})" for role, (m, c) in means.items())
            long = r.long_ttft_s.get(mode)
            print(
                f"| {k} | {mode} | {f.ttft_s * 1e3:.1f} | {f.gap_1_s * 1e3:.2f} | "
                f"{f.gap_batch_s * 1e3:.2f} | {'-' if long is None else f'{long * 1e3:.0f}'} | "
                f"{engine or '-'} |"
            )
    print("\neach run fitted alone (not used; the spec gets the fit to the medians):")
    print(_fit_header())
    for k, r in enumerate(runs, 1):
        print(f"| {k} | {' | '.join(_fit_cells(r.scale, r.overheads))} |")
    _print_scale_spread([r.scale for r in runs])


_FIT_COLUMNS = (
    "engine scale",
    "colocated loop + token ms",
    "decode loop + token ms",
    "request ms",
    "hand-off ms",
    "wake ms (colocated; prefill)",
    "warm-up ms (colocated; decode)",
    "jitter p90 / p99 ms (colocated; decode)",
    "pace p10-p90 (colocated; decode)",
)


def _fit_header(extra: tuple[str, ...] = ()) -> str:
    """The header of a table with one fitted scale and overheads a row (``_fit_cells``)."""
    header = ["run", *_FIT_COLUMNS, *extra]
    return "| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|"


def _scale_terms(scale: Any) -> list[tuple[str, float, str]]:
    """A fitted engine scale's terms as (name, value, text): a factor per role (``x1.57``), a
    fixed term (a field in seconds, ``_s``) in ms."""
    out = []
    for field in dataclasses.fields(scale):
        value = getattr(scale, field.name)
        if field.name.endswith("_s"):
            out.append((field.name.removesuffix("_s"), value * 1e3, f"{value * 1e3:.2f} ms"))
        else:
            out.append((field.name, value, f"x{value:.2f}"))
    return out


def _fit_cells(scale: Any, o: Any) -> list[str]:
    """One fit's engine scale ("-": none fitted) and overheads, as table cells."""
    scales = "-" if scale is None else ", ".join(f"{n} {t}" for n, _, t in _scale_terms(scale))
    return [
        scales,
        f"{o.colocated_loop_s * 1e3:.2f} + {o.colocated_token_s * 1e3:.3f}",
        f"{o.loop_s * 1e3:.2f} + {o.token_s * 1e3:.3f}",
        f"{o.request_s * 1e3:.1f}",
        f"{o.handoff_s * 1e3:.1f}",
        f"{o.colocated_wake_s * 1e3:.1f}; {o.prefill_wake_s * 1e3:.1f}",
        f"{o.colocated_warmup_s * 1e3:.2f}; {o.decode_warmup_s * 1e3:.2f}",
        "; ".join(
            f"{j.p90_s * 1e3:.2f} / {j.p99_s * 1e3:.2f}" for j in (o.colocated_jitter, o.jitter)
        ),
        "; ".join(f"{j.pace[1]:.2f}-{j.pace[3]:.2f}" for j in (o.colocated_jitter, o.jitter)),
    ]


def _print_scale_spread(scales: list[Any]) -> None:
    """Each engine scale term's range over the runs that fitted one (two or more)."""
    fitted = [_scale_terms(s) for s in scales if s is not None]
    if len(fitted) > 1:
        spread = ", ".join(
            f"{name} {min(t[k][1] for t in fitted):.2f}-{max(t[k][1] for t in fitted):.2f}"
            + (" ms" if unit.endswith("ms") else "x")
            for k, (name, _, unit) in enumerate(fitted[0])
        )
        print(f"the scales fitted run by run: {spread}")


_PROBE_FIT_COLUMNS = ("worst probe residual", "worst long-prompt check")


def _print_probe_fit_row(label: str, fit: Any, note_prefix: str = "note") -> None:
    """One fit made on validation meshes (``validate.RunFit``) as a row of a ``_fit_header``
    table with ``_PROBE_FIT_COLUMNS``, then its notes."""
    mesh = fit.mesh
    check = f"{mesh.max_check_error:.0%}" if mesh.checks else "-"
    cells = _fit_cells(fit.engine_scale and fit.engine_scale.scale, mesh.overheads)
    print(f"| {label} | {' | '.join([*cells, f'{mesh.max_relative_error:.0%}', check])} |")
    for note in mesh.notes:
        print(f"{note_prefix}: {note}")


def _print_pooled_fit(fit: Any, runs: int) -> None:
    """``--probe-each-run``: the fit to every probe run of the validation (each figure their
    median, the jitter their gaps together), which the pooled comparison below uses."""
    print(
        f"\nthe fit to all {runs} probe runs (each figure their median, the jitter their gaps "
        "together; the comparison below uses it):"
    )
    print(_fit_header(_PROBE_FIT_COLUMNS))
    _print_probe_fit_row("all", fit)


def _print_run_fits(fits: Any) -> None:
    """``--probe-each-run``: each repeat's scale and overheads, fitted to the two probe runs its
    meshes served (before and after the workload), with the fit's worst probe residual and its
    worst long-prompt check (nothing fitted to those)."""
    print("\neach repeat's fit to the probes on its own meshes (its own simulation uses it):")
    print(_fit_header(_PROBE_FIT_COLUMNS))
    for k, f in enumerate(fits, 1):
        _print_probe_fit_row(str(k), f, f"note (repeat {k})")
    _print_scale_spread([f.engine_scale and f.engine_scale.scale for f in fits])


def _print_engine_scale(scaled: Any) -> None:
    print("\nengine in the mesh's workers during the probe (their /metrics) against the model:")
    print(
        "| figure | mesh mean ms | count | in-process model ms | scaled model ms |\n"
        "|---|---|---|---|---|"
    )
    for f in scaled.figures:
        print(
            f"| {f.role} | {f.measured_s * 1e3:.2f} | {f.count} | {f.unscaled_s * 1e3:.2f} | "
            f"{f.scaled_s * 1e3:.2f} ({f.relative:+.1%}) |"
        )
    print("engine in the mesh: " + ", ".join(f"{n} {v}" for n, v in scaled.scale.terms()))


def _print_mesh_fit(mesh: Any) -> None:
    from kvmesh.loadgen.sim.cost import WARMUP_STEPS

    o = mesh.overheads
    print("\nmesh probe (simulated with the overheads below):")
    print("| figure | measured ms | simulated ms | residual |\n|---|---|---|---|")
    for r in mesh.residuals:
        print(
            f"| {r.label} | {r.measured_s * 1e3:.2f} | {r.simulated_s * 1e3:.2f} | "
            f"{r.relative:+.1%} |"
        )
    for r in mesh.checks:
        print(
            f"| check: {r.label} | {r.measured_s * 1e3:.2f} | {r.simulated_s * 1e3:.2f} | "
            f"{r.relative:+.1%} |"
        )
    for note in mesh.notes:
        print(f"note: {note}")
    if mesh.max_check_error > 0.25:
        print(
            f"warning: a long prompt's TTFT is off by {mesh.max_check_error:.0%} though nothing "
            "was fitted to it: the engine's calibrated prefill, or the request path, is not what "
            "the mesh shows at that length (or the machine was busy)"
        )
    if mesh.max_relative_error > 0.25:
        print(
            f"warning: a probe figure is off by {mesh.max_relative_error:.0%}: the overheads do "
            "not describe this mesh well (or the machine was busy)"
        )
    print(
        f"mesh overheads: colocated loop {o.colocated_loop_s * 1e3:.2f} ms per step + "
        f"{o.colocated_token_s * 1e3:.3f} ms per streamed token; "
        f"decode loop {o.loop_s * 1e3:.2f} ms per step + {o.token_s * 1e3:.3f} ms per "
        f"streamed token; request {o.request_s * 1e3:.1f} ms; disagg hand-off "
        f"{o.handoff_s * 1e3:.1f} ms; the first step after idling: colocated "
        f"+{o.colocated_wake_s * 1e3:.1f} ms, prefill +{o.prefill_wake_s * 1e3:.1f} ms; "
        f"a sequence's first decode step: colocated +{o.colocated_warmup_s * 1e3:.2f} ms, "
        f"decode +{o.decode_warmup_s * 1e3:.2f} ms (tapering over {WARMUP_STEPS} steps); "
        "loop step jitter over its request's median (p90, p99, max): "
        + "; ".join(
            f"{who} {j.p90_s * 1e3:.2f}, {j.p99_s * 1e3:.2f}, {j.max_s * 1e3:.1f} ms"
            for who, j in (("colocated", o.colocated_jitter), ("decode", o.jitter))
        )
        + "; each sequence's pace against the mean (min, p10, p50, p90, max): "
        + "; ".join(
            f"{who} " + ", ".join(f"{x:.2f}" for x in j.pace)
            for who, j in (("colocated", o.colocated_jitter), ("decode", o.jitter))
        )
    )


def _validate(args: argparse.Namespace, cost: Any, requests: list[Any]) -> int:
    from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
    from kvmesh.loadgen.sim import validate
    from kvmesh.loadgen.sim.overheads import OverheadFitError

    if args.trace is not None:
        return _fail("--validate runs a synthetic workload; leave out --trace")
    if args.repeats < 1:
        return _fail(f"--repeats must be at least 1, got {args.repeats}")
    if args.redo < 0:
        return _fail(f"--redo must be 0 or more, got {args.redo}")
    if args.max_steal >= 100:
        return _fail(f"--max-steal is a percentage below 100, got {args.max_steal}")
    max_steal = None if args.max_steal < 0 else args.max_steal / 100
    config = ServeBenchConfig(
        model=args.real_model,
        num_prompts=args.num_requests,
        input_len=1,
        input_len_range=args.input_len_range,
        output_len=1,
        output_len_range=args.output_len_range,
        request_rates=(args.request_rate,),
        arrival=args.arrival,
        burstiness=args.burstiness,
        seed=args.seed,
        transport=args.transport,
        compare=("colocated", "disagg"),
        prefill_nice=args.prefill_nice,
    )
    d = cost.device
    if args.probe_each_run:
        print(
            f"simulated on {d.name}'s engine figures: {d.peak_flops / 1e9:.1f} GFLOP/s, "
            f"{d.mem_bandwidth / 1e9:.2f} GB/s, {d.step_overhead_s * 1e3:.2f} ms per step; the "
            "engine scale and mesh overheads fitted to the probes served on the validation's "
            "own meshes, before and after each workload"
        )
    else:
        _print_spec_terms(d)
    modes = ("colocated", "disagg")
    try:
        served = validate.serve(
            config, modes, args.repeats, args.probe_each_run, max_steal, args.redo
        )
        runs = served.runs
        if args.probe_each_run:
            each = validate.compare_served(runs, cost, requests, args.prefill_nice, "each")
            comparisons = validate.compare_served(runs, cost, requests, args.prefill_nice, "pooled")
        else:
            comparisons = validate.compare_served(runs, cost, requests, args.prefill_nice)
    except OverheadFitError as exc:
        return _fail(f"mesh probe refused: {exc}")
    _print_disturbed(served)
    if args.probe_each_run:
        _print_run_fits(each[0].fits)
        print()
        print(validate.format_runs(each))
        print(validate.format_comparisons(each))
        _print_pooled_fit(comparisons[0].fits[0], 2 * args.repeats)
        print()
    if args.repeats > 1:
        print(validate.format_runs(comparisons))
        print(f"\npooled: the real side is every run's records ({args.repeats} x {len(requests)})")
    print(validate.format_comparisons(comparisons))
    if args.per_request:
        from kvmesh.loadgen.sim.engine_timings import format_timings
        from kvmesh.loadgen.sim.per_request import format_pairs, pair

        for c in comparisons:
            for k, run in enumerate(c.real_runs):
                label = c.mode if len(c.real_runs) == 1 else f"{c.mode}, run {k + 1}"
                print()
                print(format_pairs(label, pair(run, c.sim_of(k))))
            print(format_timings(c.mode, c.real_timings, c.sim_timings))
    if args.records_out is not None:
        args.records_out.write_text(validate.records_json(comparisons))
        print(f"wrote {args.records_out}", file=sys.stderr)
    return 0


def _print_disturbed(served: Any) -> None:
    """The repeats served again because the hypervisor disturbed them, and those kept so."""
    for s in served.set_aside:
        print(
            f"repeat {s.repeat + 1} served again: the hypervisor took {s.steal.cell()} of the CPU "
            f"during the {s.mode} mesh's probes / workload (--max-steal {served.max_steal:.0%})"
        )
    for k, mode, steal in served.kept_disturbed():
        print(
            f"warning: repeat {k + 1}'s {mode} run lost {steal.cell()} of the CPU to the "
            "hypervisor and is compared all the same (no --redo left): its machine was not "
            "the one its probes measured"
        )


def _print_spec_terms(d: Any) -> None:
    """The spec's engine figures, mesh overheads and engine scales the simulation uses."""
    print(
        f"simulated on {d.name}: {d.peak_flops / 1e9:.1f} GFLOP/s, {d.mem_bandwidth / 1e9:.2f} GB/s, "
        f"{d.step_overhead_s * 1e3:.2f} ms per step; mesh overheads: colocated loop "
        f"{d.colocated_loop_overhead_s * 1e3:.2f} ms + {d.colocated_token_overhead_s * 1e3:.3f} ms "
        f"per token, decode loop {d.loop_overhead_s * 1e3:.2f} ms + "
        f"{d.token_overhead_s * 1e3:.3f} ms per token, request "
        f"{d.request_overhead_s * 1e3:.1f} ms, hand-off {d.handoff_overhead_s * 1e3:.1f} ms, "
        f"wake colocated {d.colocated_wake_s * 1e3:.1f} ms, prefill "
        f"{d.prefill_wake_s * 1e3:.1f} ms, warm-up colocated "
        f"{d.colocated_warmup_s * 1e3:.2f} ms, decode {d.decode_warmup_s * 1e3:.2f} ms, "
        + ", ".join(
            f"{who} jitter p90 {p90 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {top * 1e3:.1f} ms"
            for who, (p90, p99, top) in (
                ("colocated", d.jitter_knots("colocated")),
                ("decode", d.jitter_knots("decode")),
            )
        )
        + ", "
        + ", ".join(
            f"{who} pace p10-p90 {knots[1]:.2f}-{knots[3]:.2f}"
            for who, knots in (
                ("colocated", d.pace_knots("colocated")),
                ("decode", d.pace_knots("decode")),
            )
        )
        + ("" if d.request_overhead_s else " (none measured: run --calibrate first)")
        + f"; engine in the mesh x{d.colocated_engine_scale:.2f} + "
        f"{d.colocated_engine_extra_s * 1e3:.2f} ms colocated, "
        f"x{d.decode_engine_scale:.2f} + {d.decode_engine_extra_s * 1e3:.2f} ms decode, "
        f"x{d.prefill_engine_scale:.2f} prefill"
    )
