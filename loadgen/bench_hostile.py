"""``kvmesh bench hostile``: normal KV writes' latency with and without hostile tcp connections.

One run, three processes: a receiver (a tcp transport with ``TransportConfig()``'s defaults, what
a decode worker of ``kvmesh up`` runs, with a pool and one window over it), a hostile process
(``hostile_load.HostileLoad``: ``--connections`` connections, by default 80% outsiders' hellos
held open, 10% a rogue member's bad keys, 10% its stalled 1 GiB frames, each reconnecting when
dropped) and this process, the normal writer. The writer runs the same phase twice, first
without the hostile process, then with it (after it has opened every connection once): every
``--interval-ms`` one write of ``--write-kib`` KiB over a long-lived endpoint (a prefill
worker's lanes), and every ``--connect-every``-th time a fresh endpoint that connects and
writes once (a new prefill lane). It prints the p50 and p99 of both, with and without, and
their ratios; failures (a refused lane, a failed write) are counted, never retried.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.shared.kv.descriptor import TransportDescriptor


def register_hostile(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "hostile", help="KV write latency with and without 2,000 hostile tcp connections"
    )
    p.add_argument("--connections", type=int, default=2000, help="hostile connections")
    p.add_argument("--duration-s", type=float, default=15.0, help="seconds per phase")
    p.add_argument("--write-kib", type=int, default=256, help="bytes per normal write (KiB)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="pause between writes")
    p.add_argument(
        "--connect-every", type=int, default=10, help="every Nth write opens a fresh endpoint"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.set_defaults(func=run)
    return p


@dataclass
class Phase:
    """One phase's latencies (seconds) and failures."""

    writes: list[float] = field(default_factory=list)
    connects: list[float] = field(default_factory=list)  # connect + first write, fresh endpoint
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {
            "writes": len(self.writes),
            "write_p50_ms": _pct(self.writes, 50),
            "write_p99_ms": _pct(self.writes, 99),
            "connects": len(self.connects),
            "connect_p50_ms": _pct(self.connects, 50),
            "connect_p99_ms": _pct(self.connects, 99),
            "failures": len(self.failures),
            "first_failure": self.failures[0] if self.failures else "",
        }


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0] * 1e3
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1e3


def _receiver_main(conn: Any, pool_bytes: int) -> None:
    """The receiver process: default transport config, one pool, one window over it."""
    from kvmesh.shared.transport import Access, TransportConfig
    from kvmesh.shared.transport.tcp import TcpTransport

    async def main() -> None:
        async with TcpTransport(TransportConfig()) as rx:
            mem = rx.allocate(pool_bytes)
            region = rx.register(mem, Access.REMOTE_WRITE)
            window = rx.open_window(region, [(region.addr, region.length)])
            conn.send((rx.descriptor(), window.rkey, region.addr))
            completions = 0
            while not conn.poll():
                while rx.completion_queue.get_nowait() is not None:
                    completions += 1
                await asyncio.sleep(0.05)
            server = rx._server
            assert server is not None
            conn.send(
                {
                    "completions": completions,
                    "admitted": server.num_accepted,
                    "refused_connections": server.num_refused,
                    "peak_connections": server.peak_connections,
                    "dropped_lanes": rx.num_dropped,
                    "refused_accesses": rx.stats().refused,
                }
            )

    asyncio.run(main())


def _hostile_main(conn: Any, port: int, secret: bytes, total: int, addr: int) -> None:
    """The hostile process: opens every connection, says so, holds on until told to stop."""
    from kvmesh.loadgen.hostile_load import HostileLoad, mix

    async def main() -> None:
        async with HostileLoad("127.0.0.1", port, secret, mix(total), addr) as attack:
            while sum(attack.tally.connects.values()) < total:
                await asyncio.sleep(0.05)
            conn.send("ready")
            while not conn.poll():
                await asyncio.sleep(0.05)
            tally = attack.tally
        conn.send(
            {
                name: dict(getattr(tally, name))
                for name in ("connects", "dropped", "frames", "admitted")
            }
        )

    asyncio.run(main())


async def _phase(
    args: argparse.Namespace, desc: TransportDescriptor, rkey: int, addr: int
) -> Phase:
    import torch
    from kvmesh.shared.transport import TransportConfig, TransportError, WriteEntry
    from kvmesh.shared.transport.tcp import TcpTransport

    phase = Phase()
    nbytes = args.write_kib << 10
    # over TCP, as the flood: not the same-host unix socket (unix_lanes), which it cannot reach
    async with TcpTransport(TransportConfig(tcp_unix_lanes=False)) as tx:
        src = tx.register(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        entry = WriteEntry(src, 0, addr, rkey, nbytes)
        ep = await tx.connect(desc)
        deadline, i = time.monotonic() + args.duration_s, 0
        while time.monotonic() < deadline:
            i += 1
            started = time.perf_counter()
            try:
                if i % args.connect_every == 0:
                    async with await tx.connect(desc) as fresh:
                        await asyncio.wait_for(fresh.write([entry], i & 0xFFF), 30)
                    phase.connects.append(time.perf_counter() - started)
                else:
                    await asyncio.wait_for(ep.write([entry], i & 0xFFF), 30)
                    phase.writes.append(time.perf_counter() - started)
            except (TransportError, TimeoutError) as exc:
                phase.failures.append(repr(exc))
                await ep.aclose()
                ep = await tx.connect(desc)  # as a prefill worker drops a failed endpoint
            await asyncio.sleep(args.interval_ms / 1000)
        await ep.aclose()
    return phase


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    import torch
    from kvmesh.shared.transport.lane_auth import parse_secret

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    rx_conn, rx_child = ctx.Pipe()
    receiver = ctx.Process(target=_receiver_main, args=(rx_child, 64 << 20), daemon=True)
    receiver.start()
    hostile = None
    try:
        desc, rkey, addr = rx_conn.recv()  # a TransportDescriptor (pickled)
        tcp = desc.backend("tcp")
        secret, port = parse_secret(tcp.secret), tcp.port
        quiet = asyncio.run(_phase(args, desc, rkey, addr))
        h_conn, h_child = ctx.Pipe()
        hostile = ctx.Process(
            target=_hostile_main, args=(h_child, port, secret, args.connections, addr), daemon=True
        )
        hostile.start()
        ramp = time.monotonic()
        if not h_conn.poll(120) or h_conn.recv() != "ready":
            print("the hostile process did not open its connections in 120 s")
            return 1
        ramp_s = time.monotonic() - ramp
        loaded = asyncio.run(_phase(args, desc, rkey, addr))
        h_conn.send("stop")
        tally = h_conn.recv()
        rx_conn.send("stop")
        receiver_stats = rx_conn.recv()
    finally:
        for proc in (hostile, receiver):
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
    q, h = quiet.summary(), loaded.summary()
    ratios = {
        k: round(h[k] / q[k], 2)
        for k in ("write_p50_ms", "write_p99_ms", "connect_p50_ms", "connect_p99_ms")
    }
    result = {
        "connections": args.connections,
        "ramp_s": round(ramp_s, 1),
        "quiet": q,
        "hostile": h,
        "ratio": ratios,
        "attack": tally,
        "receiver": receiver_stats,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"kvmesh bench hostile: {args.connections} hostile connections (opened in {ramp_s:.1f} s), "
        f"{args.write_kib} KiB writes every {args.interval_ms:g} ms for {args.duration_s:g} s"
    )
    print(f"{'':10} {'writes':>7} {'p50 ms':>8} {'p99 ms':>8} {'connects':>9} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'failures':>9}")  # fmt: skip
    for name, s in (("quiet", q), ("hostile", h)):
        print(
            f"{name:10} {s['writes']:>7} {s['write_p50_ms']:>8.2f} {s['write_p99_ms']:>8.2f} "
            f"{s['connects']:>9} {s['connect_p50_ms']:>8.2f} {s['connect_p99_ms']:>8.2f} "
            f"{s['failures']:>9}"
        )
    print(
        f"{'ratio':10} {'':>7} {ratios['write_p50_ms']:>8.2f} {ratios['write_p99_ms']:>8.2f} "
        f"{'':>9} {ratios['connect_p50_ms']:>8.2f} {ratios['connect_p99_ms']:>8.2f}"
    )
    if h["first_failure"]:
        print(f"first failure under attack: {h['first_failure']}")
    print(f"attack: {tally}")
    print(f"receiver: {receiver_stats}")
    return 0


__all__ = ["register_hostile", "run"]
