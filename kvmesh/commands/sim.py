"""``kvmesh sim``: simulate a kvmesh cluster on a workload, plan its prefill:decode split,
calibrate this machine as a device spec, or check the simulator against the real mesh.

- default: run one topology (``--mode``, ``--prefill``, ``--decode``, ``--chunk-tokens``) and
  print its row;
- ``--plan``: colocated continuous batching, colocated with chunked prefill, and the planner's
  disaggregated split on ``--gpus``, with the planner's reasons (``--plot-dir``: PNGs);
- ``--calibrate``: measure this machine with the real engine and transport, then what a real
  local mesh adds to the engine (a small probe workload, not the validation's), write a device
  spec;
- ``--slo-plan``: every candidate (the two meshes ``kvmesh up`` starts on a CPU host; colocated
  and each P:D split of ``--gpus`` accelerators) swept over ``--slo-sweep`` rates, judged as
  ``bench serve --slo-sweep`` judges real runs; ``--slo-measured FILE`` sets the predicted
  goodputs beside a measured ``slo_sweep.json`` (``sim_slo.py``);
- ``--validate``: the same workload simulated and served by a local mesh (colocated and disagg),
  sim/real ratios of p50/p99 TTFT and ITL (``--probe-each-run``: each mesh serves the probe
  before and after its workload; the simulation is fitted to the median of all those probe
  runs, and, printed apart, each repeat to its own).

Torch is imported by ``--calibrate`` and ``--validate`` only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.commands import sim_report, sim_slo, sim_workload
from kvmesh.sim.specs import SPEC_DIR

if TYPE_CHECKING:
    from kvmesh.sim.cost import CostModel
    from kvmesh.sim.sla import Sla
    from kvmesh.sim.specs import ModelSpec
    from kvmesh.sim.topology import Mode, Topology
    from kvmesh.sim.workload import SimRequest

DEFAULT_CPU_SPEC = SPEC_DIR / "devices" / "cpu.json"


def register(subparsers: argparse._SubParsersAction) -> None:
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
    action.add_argument(
        "--slo-plan",
        action="store_true",
        help="which mode and split meets --slo-base at the highest rate (SLO attainment)",
    )

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
    sim_workload.register(load)
    load.add_argument("--trace", type=Path, help="JSONL trace instead of the synthetic workload")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--sla", default="ttft_ms=1500,itl_ms=30", help="p99 TTFT and ITL limits")

    sim_slo.register(p)

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


def _sla(text: str) -> Sla:
    from kvmesh.sim.sla import Sla

    values = {}
    for part in filter(None, (x.strip() for x in text.split(","))):
        key, _, raw = part.partition("=")
        if key not in ("ttft_ms", "itl_ms"):
            raise ValueError(f"--sla {part!r}: expected ttft_ms=MS,itl_ms=MS")
        values[key] = float(raw)
    if set(values) != {"ttft_ms", "itl_ms"}:
        raise ValueError("--sla needs both ttft_ms and itl_ms")
    return Sla(**values)


def _requests(args: argparse.Namespace) -> list[SimRequest]:
    return sim_workload.requests(args)


def run(args: argparse.Namespace) -> int:
    from kvmesh.loadgen.arrivals import TraceError
    from kvmesh.loadgen.workload import WorkloadError
    from kvmesh.sim.cost import CostModel
    from kvmesh.sim.specs import SpecError, load_device, load_model

    try:
        model = load_model(args.model)
        if args.calibrate:
            return _calibrate(args, model)
        device = load_device(args.device)
        cost = CostModel(model, device, args.tp)
        sim_workload.resolve(args)
        if args.slo_plan:
            return sim_slo.run(args, cost)
        sla = _sla(args.sla)
        requests = _requests(args)
        if args.validate:
            return _validate(args, cost, requests)
        if args.plan:
            return _plan(args, cost, requests, sla)
        return _one(args, cost, requests, sla)
    except (SpecError, TraceError, WorkloadError, ValueError) as exc:
        return _fail(str(exc))


def _topology(
    args: argparse.Namespace,
    mode: Mode | None = None,
    *,
    num_prefill: int = 0,
    num_decode: int = 1,
    chunk_tokens: int | None = None,
) -> Topology:
    """The topology of ``--mode``, ``--prefill``, ``--decode`` and ``--chunk-tokens``; with
    ``mode``, that mode with ``num_prefill``, ``num_decode`` and ``chunk_tokens`` instead. The
    rest (``--max-num-seqs``, ``--tp``, ...) from ``args`` either way."""
    from kvmesh.sim.topology import Topology

    if mode is None:
        mode, num_decode = args.mode, args.decode
        num_prefill = args.prefill if args.mode == "disagg" else 0
        chunk_tokens = args.chunk_tokens or None
    return Topology(
        mode=mode,
        num_decode=num_decode,
        num_prefill=num_prefill,
        chunk_tokens=chunk_tokens,
        max_num_seqs=args.max_num_seqs,
        tp=args.tp,
        decode_pacing_s=args.decode_pacing_ms / 1e3,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )


def _one(args: argparse.Namespace, cost: CostModel, requests: list[SimRequest], sla: Sla) -> int:
    from kvmesh.sim.cluster import simulate
    from kvmesh.sim.report import format_table, result_row

    topology = _topology(args)
    result = simulate(topology, cost, requests, sla.slo)
    print(sim_report.assumptions(cost, requests, sla))
    print(format_table([result_row(topology.label, result, sla)]))
    return 0


def _plan(args: argparse.Namespace, cost: CostModel, requests: list[SimRequest], sla: Sla) -> int:
    from kvmesh.sim import planner
    from kvmesh.sim.cluster import simulate
    from kvmesh.sim.report import format_table, result_row

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
    print(sim_report.assumptions(cost, requests, sla))
    print(format_table(rows))
    print()
    print("\n".join(planner.explain(plan)))
    print()
    print("every split at chunk", chunk)
    print(format_table([result_row(c.topology.label, c.result, sla) for c in plan.splits]))
    if args.plot_dir is not None:
        from kvmesh.sim import plots

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


def _calibrate(args: argparse.Namespace, model: ModelSpec) -> int:
    from kvmesh.sim.calibrate import calibrate
    from kvmesh.sim.fit import FitError
    from kvmesh.sim.probe_figures import OverheadFitError
    from kvmesh.sim.specs import write_device

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
    sim_report.print_calibration(result, model)
    print(f"wrote {write_device(result.spec, args.out or DEFAULT_CPU_SPEC)}")
    return 0


def _validate(args: argparse.Namespace, cost: CostModel, requests: list[SimRequest]) -> int:
    from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
    from kvmesh.sim import validate
    from kvmesh.sim.probe_figures import OverheadFitError

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
        input_len=args.input_len or 1,
        input_len_dist=args.input_len_dist,
        input_len_sd=args.input_len_sd,
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
    if args.probe_each_run:
        sim_report.print_engine_figures(cost.device)
    else:
        sim_report.print_spec_terms(cost.device)
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
    sim_report.print_disturbed(served)
    if args.probe_each_run:
        sim_report.print_run_fits(each[0].fits)
        print()
        print(validate.format_runs(each))
        print(validate.format_comparisons(each))
        sim_report.print_pooled_fit(comparisons[0].fits[0], 2 * args.repeats)
        print()
    if args.repeats > 1:
        print(validate.format_runs(comparisons))
        print(f"\npooled: the real side is every run's records ({args.repeats} x {len(requests)})")
    print(validate.format_comparisons(comparisons))
    if args.per_request:
        sim_report.print_per_request(comparisons)
    if args.records_out is not None:
        args.records_out.write_text(validate.records_json(comparisons))
        print(f"wrote {args.records_out}", file=sys.stderr)
    return 0
