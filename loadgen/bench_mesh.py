"""``python -m kvmesh.loadgen.bench_mesh`` (``kvmesh bench mesh``): how much KV transfer the prefill hides.

Starts a real local mesh (``kvmesh up``'s Launcher: nats-server, kv-registry, one prefill, one
decode, the router), sends long prompts through the router's HTTP API one at a time, and reads
each request's PrefillReport from NATS: compute (forward passes), transfer (sum of chunk write
durations) and exposed transfer (time from the last forward pass to the last write landing, i.e.
what compute did not hide). With chunk i's write overlapping chunk i+1's forward pass, only the
last chunk's write is exposed, so exposed/transfer falls like 1/num_chunks.

The mesh comes from the tests' harness, ``kvmesh.testing.mesh``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

from kvmesh.loadgen.module_main import run_module

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts

# ---- the benchmark -----------------------------------------------------------------------------


async def measure(url: str, nats_url: str, prompts: list[list[int]], auth: Any = None) -> list[Any]:
    import aiohttp

    reports = []
    async with MeshTap(nats_url, auth) as tap, aiohttp.ClientSession() as session:
        warm_up = random_prompts(1, 64, 64, seed=999_999)[0]  # connects prefill to decode
        await complete(session, url, warm_up, 1)
        for prompt in prompts:
            reply = await complete(session, url, prompt, 1)
            rid = reply["id"]
            for _ in range(100):
                if rid in tap.reports:
                    break
                await asyncio.sleep(0.02)
            reports.append(tap.reports[rid])
    return reports


def run(args: argparse.Namespace) -> int:
    env = {"KVMESH_CHUNK_TOKENS": str(args.chunk_tokens), "KVMESH_BLOCK_SIZE": "16"}
    if args.prefill_tp > 1:  # the prefill worker's --tp (docs/tp.md)
        env["KVMESH_TP"] = str(args.prefill_tp)
    prompts = random_prompts(args.repeats, args.prompt_len, args.prompt_len, seed=1)
    with local_mesh("disagg", args.transport, env=env) as mesh:
        reports = asyncio.run(measure(mesh.url, mesh.config.nats_url, prompts, mesh.nats_auth))
    ratios = [r.exposed_transfer_s / r.transfer_s for r in reports if r.transfer_s > 0]
    print(
        f"transport {args.transport}, prompt {args.prompt_len} tokens, chunk {args.chunk_tokens} "
        f"tokens, prefill TP {args.prefill_tp}, {len(reports)} requests one at a time"
    )
    print(
        f"{'chunks':>6} {'compute_ms':>11} {'transfer_ms':>12} {'exposed_ms':>11} {'exposed/transfer':>17}"
    )
    for r in reports:
        print(
            f"{r.num_chunks:6d} {r.compute_s * 1e3:11.2f} {r.transfer_s * 1e3:12.3f} "
            f"{r.exposed_transfer_s * 1e3:11.3f} {r.exposed_transfer_s / r.transfer_s:17.1%}"
        )
    median = statistics.median(ratios)
    print(f"median exposed/transfer {median:.1%} (target < 10% for >= 8 chunks)")
    return 0 if median < args.max_exposed_ratio else 1


def register_mesh(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("mesh", help="exposed vs total KV transfer time of chunked remote prefill")
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default="shm", choices=("auto", "shm", "tcp", "rdma"))
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-exposed-ratio", type=float, default=0.10)
    p.add_argument(
        "--prefill-tp",
        type=int,
        default=1,
        help="the prefill worker's tensor parallelism; its report times rank 0's writes only "
        "(each rank writes its own heads of every chunk)",
    )


if __name__ == "__main__":
    run_module("bench_mesh", __doc__, add_arguments, run)
