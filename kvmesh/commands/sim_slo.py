"""``kvmesh sim --slo-plan``: which mode and split meets an SLO at the highest request rate,
by simulation, judged as ``kvmesh bench serve --slo-sweep`` judges real runs (``slo_plan.py``).

The candidates: on a CPU host (a calibrated ``cpu`` spec) the two meshes ``kvmesh up`` starts on
its cores, labelled ``colocated`` and ``disagg`` as ``bench serve --compare`` labels them, so
``--slo-measured`` can set each predicted goodput beside the measured one; on accelerators,
colocated on all ``--gpus`` and every disaggregated P:D split of them.

    kvmesh sim --slo-plan --device cpu.json --model seeded-23m --workload longtail \\
        --slo-sweep 0.2,0.4,0.6,0.8,1.2 --slo-base ttft_ms=3000,tpot_ms=50,gap_ms=250 \\
        --slo-measured slo-sweep/slo_sweep.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.sim.cost import CostModel
    from kvmesh.sim.topology import Topology


def register(p: argparse.ArgumentParser) -> None:
    slo = p.add_argument_group("--slo-plan (SLO attainment, as bench serve --slo-sweep)")
    slo.add_argument(
        "--slo-sweep",
        help="request rates to sweep, e.g. 0.2,0.4,0.8 (default: the measured sweep's, with "
        "--slo-measured)",
    )
    slo.add_argument(
        "--slo-base",
        help="the base objective, e.g. ttft_ms=3000,tpot_ms=50,gap_ms=250 (default: the "
        "measured sweep's with --slo-measured, else that one)",
    )
    slo.add_argument(
        "--slo-scales", help="three multiples of --slo-base: tight, medium, loose (default 0.5,1,2)"
    )
    slo.add_argument(
        "--slo-measured",
        type=Path,
        help="a measured `bench serve --slo-sweep` slo_sweep.json: its rates, objective and "
        "scales are simulated, and each goodput is set beside the measured one (within 25%%?)",
    )


def _fail(message: str) -> int:
    print(f"kvmesh sim: {message}", file=sys.stderr)
    return 2


def candidates(args: argparse.Namespace, cost: CostModel) -> tuple[dict[str, Topology], int]:
    """The labelled topologies to compare and the cores (devices) goodput is divided by."""
    from dataclasses import replace

    from kvmesh.sim.topology import Topology
    from kvmesh.sim.validate_compare import mesh_topology

    device = cost.device
    if device.cores > 1 or device.name.startswith("cpu"):
        nice = getattr(args, "prefill_nice", 0)
        return {
            mode: mesh_topology(mode, cost, nice) for mode in ("colocated", "disagg")
        }, device.cores
    workers = args.gpus // args.tp
    if workers < 2:
        raise ValueError(f"--gpus {args.gpus} holds {workers} worker(s) of --tp {args.tp}: need 2")
    chunk = args.chunk_tokens or 2048
    base = Topology(
        "colocated",
        num_decode=workers,
        chunk_tokens=chunk,
        max_num_seqs=args.max_num_seqs,
        tp=args.tp,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    out = {base.label: base}
    for p in range(1, workers):
        t = replace(base, mode="disagg", num_prefill=p, num_decode=workers - p)
        out[t.label] = t
    return out, args.gpus


def run(args: argparse.Namespace, cost: CostModel) -> int:
    import orjson

    from kvmesh.commands import sim_workload
    from kvmesh.loadgen import slo_attainment
    from kvmesh.sim import slo_plan

    measured = None
    base = scales = rates = None
    if args.slo_measured is not None:
        try:
            measured = orjson.loads(args.slo_measured.read_bytes())
            base, scales, rates = slo_plan.measured_setup(measured)
        except (OSError, orjson.JSONDecodeError, ValueError) as exc:
            return _fail(f"--slo-measured {args.slo_measured}: {exc}")
    if args.slo_base is not None:
        base = slo_attainment.SloObjective.parse(args.slo_base)
    if args.slo_scales is not None:
        scales = slo_attainment.parse_scales(args.slo_scales)
    if args.slo_sweep is not None:
        try:
            rates = [float(r) for r in args.slo_sweep.split(",") if r.strip()]
        except ValueError:
            return _fail(f"--slo-sweep {args.slo_sweep!r}: give request rates, e.g. 0.2,0.4,0.8")
    if not rates:
        return _fail("--slo-plan needs --slo-sweep RATES (or --slo-measured FILE)")
    if args.trace is not None:
        return _fail("--slo-plan sends the synthetic workload at each rate; leave out --trace")
    topologies, cores = candidates(args, cost)
    plan = slo_plan.sweep(
        topologies,
        cost,
        lambda rate: sim_workload.requests(args, rate),
        rates,
        base or slo_attainment.SloObjective.parse("ttft_ms=3000,tpot_ms=50,gap_ms=250"),
        scales or slo_attainment.DEFAULT_SCALES,
        cores,
    )
    print(
        f"simulated: {cost.model.name} on {cost.device.name}, {args.num_requests} requests a "
        f"rate ({args.input_len_dist} prompt lengths {args.input_len_range}, output "
        f"{args.output_len_range}, {args.arrival} arrivals)"
    )
    print(
        slo_attainment.format_sweep(plan.points, plan.goodputs, plan.base, plan.scales, plan.target)
    )
    print("\n".join(slo_plan.format_best(plan)))
    if measured is not None:
        checks = slo_plan.compare_measured(plan, measured)
        if not checks:
            return _fail(
                f"--slo-measured {args.slo_measured}: no target there is a candidate here "
                f"(measured {sorted({g['label'] for g in measured['goodput']})}, simulated "
                f"{sorted(topologies)})"
            )
        print(f"\nsimulated goodput against {args.slo_measured}:")
        print(slo_plan.format_checks(checks))
    return 0
