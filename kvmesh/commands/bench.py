"""``kvmesh bench engine|xfer|kv|mesh|serve|spec|gc|hostile|tp``: benchmarks. Each lives in ``loadgen/`` and exposes
``register_<name>(subparsers)``, which adds its parser with ``func`` set."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="benchmarks (engine, xfer, kv, mesh, serve, spec, gc, hostile, tp)"
    )
    sub = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from kvmesh.loadgen.bench_engine import register_engine
    from kvmesh.loadgen.bench_gc import register_gc
    from kvmesh.loadgen.bench_hostile import register_hostile
    from kvmesh.loadgen.bench_kv import register_kv
    from kvmesh.loadgen.bench_mesh import register_mesh
    from kvmesh.loadgen.bench_serve import register_serve
    from kvmesh.loadgen.bench_spec import register_spec
    from kvmesh.loadgen.bench_tp import register_tp
    from kvmesh.loadgen.bench_xfer import register_xfer

    register_engine(sub)
    register_xfer(sub)
    register_kv(sub)
    register_mesh(sub)
    register_serve(sub)
    register_spec(sub)
    register_gc(sub)
    register_hostile(sub)
    register_tp(sub)
