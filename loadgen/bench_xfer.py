"""``kvmesh bench xfer``: GB/s of moving scattered KV blocks between two processes.

A transfer of N bytes is N / 2 MiB scattered 16-token blocks of a Llama-3-8B KV cache (32 layers,
8 KV heads, head_dim 128, bf16), taken from random blocks of a source KVPool and placed into random
blocks of a destination KVPool, each pool a quarter larger than the transfer. Backends:

- ``memcpy``: torch ``copy_`` block by block in one process (the ceiling for same-host moves);
- ``socket``: one loopback TCP socket, ``sendall`` per block / ``recv_into`` the destination block;
- ``gloo``: torch.distributed gloo ``send`` / ``recv`` per block;
- ``shm``, ``tcp``, ``rdma``: kvmesh transports, one batched ``write`` of every block per transfer
  (``tcp`` over loopback TCP; ``tcp-unix``, only when named in ``--backends``: the tcp transport
  over its same-host unix socket, ``shared/transport/unix_lanes.py``).

Every process uses one torch thread. Except memcpy, the sender is this process and the receiver a
spawned one; each repetition is timed on the sender until the receiver has every byte (the write
returned / the receiver's ack). Figures are the best of ``--repeats`` timed runs (up to 4x more for
transfers under 256 MiB) after ``--warmup`` runs, over ``--rounds`` passes through all backends
(so that no backend is measured only during a burst of load from other processes). The destination pool starts zeroed and its
blocks' CRC32 is compared with the source's after each backend's run; transports must also deliver
exactly one completion per write, in order.

The torch side (the KV pools, the receiver processes and the senders) is ``kvmesh.loadgen.xfer_backends``,
imported by ``run`` only, so that building the ``kvmesh`` parser does not import torch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# One 16-token block of the Llama-3-8B KV cache in bf16 (kvmesh.loadgen.xfer_backends.SPEC asserts it).
# A constant here, so that building the CLI parser does not import torch.
BLOCK_BYTES = 2 << 20
# "tcp" is TCP over loopback; "tcp-unix" the tcp transport over its same-host unix socket
# (what two kvmesh processes on one host use when shm is not chosen), only when named
TRANSPORTS = ("shm", "tcp", "tcp-unix", "rdma")
BASELINES = ("memcpy", "socket", "gloo")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def register_xfer(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("xfer", help="KV block transfer GB/s: transports vs memcpy/socket/gloo")
    p.add_argument("--json", action="store_true", help='print {"results": [...]} only')
    p.add_argument("--sizes", default="16M,64M,256M,1G", help="transfer sizes (K/M/G suffixes)")
    p.add_argument("--backends", default=None, help="comma list; default all available")
    p.add_argument(
        "--repeats", type=int, default=5, help="timed runs per size (more for sizes < 256 MiB)"
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--rounds", type=int, default=2, help="passes over all backends; the best of each is kept"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
    return p


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = _UNITS.get(text[-1:], 1)
    try:
        value = int(text[:-1] if text[-1:] in _UNITS else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 16M, 1G") from None
    if value < BLOCK_BYTES or value % BLOCK_BYTES:
        raise argparse.ArgumentTypeError(
            f"size {text} must be a positive multiple of the {BLOCK_BYTES >> 20} MiB block"
        )
    return value


@dataclass(frozen=True, slots=True)
class XferPlan:
    """Which source blocks go to which destination blocks for one transfer size."""

    num_bytes: int
    pool_blocks: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    runs: int = 1  # warm-up + timed

    @classmethod
    def make(cls, num_bytes: int, seed: int, runs: int = 1) -> XferPlan:
        n = num_bytes // BLOCK_BYTES
        pool = n + max(2, n // 4)
        rng = random.Random(seed * 1_000_003 + n)
        src, dst = rng.sample(range(pool), n), rng.sample(range(pool), n)
        return cls(num_bytes, pool, tuple(src), tuple(dst), runs)


@dataclass(frozen=True, slots=True)
class Result:
    backend: str
    num_bytes: int
    gbps: float


def runs_for(num_bytes: int, repeats: int) -> int:
    """Timed runs: small transfers are over in milliseconds, so they get more tries (up to 4x)
    against scheduling noise on a shared machine."""
    return max(repeats, min(4 * repeats, repeats * ((256 << 20) // num_bytes)))


def default_backends() -> list[str]:
    from kvmesh.shared.transport.auto import available_backends

    avail = available_backends()
    return [*BASELINES, *(b for b in ("shm", "tcp", "rdma") if avail[b][0])]


def format_table(results: list[Result]) -> str:
    base = {(r.backend, r.num_bytes): r.gbps for r in results}
    header = (
        f"{'size':>8}  {'backend':<8} {'GB/s':>7}  {'x memcpy':>8} {'x socket':>8} {'x gloo':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in sorted(results, key=lambda r: (r.num_bytes, _order(r.backend))):
        ratios = []
        for ref, width in (("memcpy", 8), ("socket", 8), ("gloo", 7)):
            ref_gbps = base.get((ref, r.num_bytes))
            ratios.append(f"{r.gbps / ref_gbps:>{width}.2f}" if ref_gbps else f"{'-':>{width}}")
        size = f"{r.num_bytes >> 20} MiB"
        lines.append(f"{size:>8}  {r.backend:<8} {r.gbps:>7.2f}  {' '.join(ratios)}")
    return "\n".join(lines)


def _order(backend: str) -> int:
    names = [*BASELINES, *TRANSPORTS]
    return names.index(backend) if backend in names else len(names)


def run(args: argparse.Namespace) -> int:
    import torch
    from kvmesh.loadgen.xfer_backends import bench_backend

    # One intra-op thread per process: on a shared machine OpenMP's spinning barriers around each
    # 2 MiB copy_ turn the memcpy baseline (and shm's copies) into noise.
    torch.set_num_threads(1)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.backends:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        unknown = sorted(set(backends) - set(BASELINES) - set(TRANSPORTS))
        if unknown:
            print(
                f"unknown backend(s) {unknown}; choose from {[*BASELINES, *TRANSPORTS]}",
                file=sys.stderr,
            )
            return 2
        if "rdma" in backends:
            from kvmesh.shared.transport.rdma_device import rdma_available

            ok, why = rdma_available()
            if not ok:
                print(f"rdma backend unavailable: {why}", file=sys.stderr)
                return 2
    else:
        backends = default_backends()
    plans = [XferPlan.make(n, args.seed, args.warmup + runs_for(n, args.repeats)) for n in sizes]
    best: dict[tuple[str, int], Result] = {}
    for round_idx in range(args.rounds):  # rounds spread each backend over time: fairer ratios
        for backend in backends:
            for r in bench_backend(backend, plans, args.warmup):
                key = (r.backend, r.num_bytes)
                if key not in best or r.gbps > best[key].gbps:
                    best[key] = r
            if not args.json:
                print(f"  round {round_idx + 1}/{args.rounds}: {backend} done", file=sys.stderr)
    results = list(best.values())
    if args.json:
        rows = [
            {"backend": r.backend, "bytes": r.num_bytes, "gbps": round(r.gbps, 3)} for r in results
        ]
        print(json.dumps({"results": rows}))
    else:
        print(format_table(results))
    return 0


def run_alone(
    prog: str,
    name: str,
    register: Callable[[Any], argparse.ArgumentParser],
    argv: Sequence[str] | None = None,
) -> int:
    """One ``kvmesh bench`` subcommand run as a module of its own (``python -m``): ``argv``
    (default: the process's arguments) parsed as subcommand ``name``'s, then its handler run."""
    parser = argparse.ArgumentParser(prog=prog)
    sub = parser.add_subparsers(dest="bench", required=True)
    register(sub)
    args = parser.parse_args([name, *(argv if argv is not None else sys.argv[1:])])
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    return run_alone("bench_xfer", "xfer", register_xfer, argv)


if __name__ == "__main__":
    sys.exit(main())
