"""``kvmesh bench kv``: one-sided read GB/s against write GB/s for the same bytes, per transport.

What a KV store's hit costs: a reader pulls scattered blocks of a remote pool straight into its
own pool (``Endpoint.read``, RDMA READ semantics) where a prefill worker pushes them
(``Endpoint.write``). Same plans as ``kvmesh bench xfer`` (scattered 2 MiB blocks of the
Llama-3-8B layout, pools a quarter larger than the transfer); an owner process holds the remote
pool behind one window granting read and write, and this process writes every block into it,
then reads them all back into a second pool, each timed on its own. Every read-back is
CRC-checked against the source. The figure of merit is ``read / write`` (issue #14: >= 0.8).

``--multi-turn`` measures the other figure of issue #14 instead: time to first token of a
multi-turn chat workload on a mesh with the kv-store and prefix routing against one without
(``loadgen/bench_kv_turns.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.loadgen.bench_kv_turns import add_arguments as add_multi_turn_arguments
from kvmesh.loadgen.bench_xfer import TRANSPORTS, XferPlan, parse_size, run_alone, runs_for


@dataclass(frozen=True, slots=True)
class KvResult:
    backend: str
    num_bytes: int
    write_gbps: float
    read_gbps: float

    @property
    def ratio(self) -> float:
        return self.read_gbps / self.write_gbps

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "bytes": self.num_bytes,
            "write_gbps": round(self.write_gbps, 3),
            "read_gbps": round(self.read_gbps, 3),
            "read_over_write": round(self.ratio, 3),
        }


def register_kv(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "kv",
        help="one-sided read GB/s against write GB/s, per transport; --multi-turn: chat TTFT "
        "with the kv-store and prefix routing against without",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object only")
    p.add_argument("--sizes", default="16M,64M,256M", help="transfer sizes (K/M/G suffixes)")
    p.add_argument(
        "--backends", default=None, help="comma list of shm,tcp,rdma; default all available"
    )
    p.add_argument(
        "--repeats", type=int, default=5, help="timed runs per size (more below 256 MiB)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2, help="passes over all backends; best kept")
    p.add_argument("--seed", type=int, default=0)
    add_multi_turn_arguments(p)
    p.set_defaults(func=run)
    return p


def format_table(results: list[KvResult]) -> str:
    header = f"{'size':>8}  {'backend':<8} {'write GB/s':>10} {'read GB/s':>10} {'read/write':>10}"
    lines = [header, "-" * len(header)]
    for r in sorted(results, key=lambda r: (r.num_bytes, TRANSPORTS.index(r.backend))):
        size = f"{r.num_bytes >> 20} MiB"
        lines.append(
            f"{size:>8}  {r.backend:<8} {r.write_gbps:>10.2f} {r.read_gbps:>10.2f} {r.ratio:>10.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.multi_turn:
        from kvmesh.loadgen.bench_kv_turns import run as run_multi_turn

        return run_multi_turn(args)
    import torch
    from kvmesh.loadgen.kv_bandwidth import bench_read_write
    from kvmesh.shared.transport.auto import available_backends

    torch.set_num_threads(1)  # as bench xfer: one intra-op thread per process
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    avail = available_backends()
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        for b in backends:
            if b not in TRANSPORTS:
                print(f"unknown backend {b!r}; choose from {list(TRANSPORTS)}", file=sys.stderr)
                return 2
            if not avail[b][0]:
                print(f"{b} backend unavailable: {avail[b][1]}", file=sys.stderr)
                return 2
    else:
        backends = [b for b in TRANSPORTS if avail[b][0]]
    plans = [XferPlan.make(n, args.seed, args.warmup + runs_for(n, args.repeats)) for n in sizes]
    best: dict[tuple[str, int], KvResult] = {}
    for round_idx in range(args.rounds):
        for backend in backends:
            for r in bench_read_write(backend, plans, args.warmup):
                key = (r.backend, r.num_bytes)
                old = best.get(key)
                best[key] = KvResult(
                    r.backend,
                    r.num_bytes,
                    max(r.write_gbps, old.write_gbps if old else 0.0),
                    max(r.read_gbps, old.read_gbps if old else 0.0),
                )
            if not args.json:
                print(f"  round {round_idx + 1}/{args.rounds}: {backend} done", file=sys.stderr)
    results = list(best.values())
    if args.json:
        print(json.dumps({"results": [r.to_dict() for r in results]}))
    else:
        print(format_table(results))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("bench_kv", "kv", register_kv, argv)


if __name__ == "__main__":
    sys.exit(main())
