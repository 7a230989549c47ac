"""``python -m kvmesh.loadgen.fault_drill SCENARIO``: a fault injected into a real local mesh
under streaming load, and what the clients saw.

Scenarios (docs/faults.md; each on a mesh ``kvmesh up``'s Launcher starts, its supervisor running):

- ``nats-outage``: kill -9 of the nats-server the launcher started, while streams are in flight;
  the supervisor starts it again on its port after ``--outage-s``;
- ``registry-kill``: requests whose placement the kv-registry holds (it is stopped, asked, then
  killed); the supervisor restarts it and the router asks the new one;
- ``worker-kill``: kill -9 of one service (``--worker``: decode-0, prefill-0, kv-store-0,
  draft-0 ...) at the load's first token; the supervisor restarts it;
- ``decode-stop``: SIGSTOP of a decode worker for ``--outage-s`` under load, then SIGCONT (its
  blocks are counted from the SIGCONT if the load ended first);
- ``stalled-clients``: clients that stop reading (small receive buffers) beside normal streams.

Each prints how many requests ended with the offline engine's greedy text, how many with a clear
error (an HTTP error status, an SSE error event), how many hung; how long after the end of the
load every decode block was free again; and, with stalled clients, the normal streams' worst
token gap. The scenarios are in ``fault_scenarios.py`` (the fault tests run them too:
tests/mesh/test_mesh_fault_drills.py), their clients in ``drill_streams.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from kvmesh.loadgen.drill_streams import MODEL, tally
from kvmesh.loadgen.fault_scenarios import (
    decode_stop,
    nats_outage,
    registry_kill,
    stalled_clients,
    worker_kill,
)
from kvmesh.loadgen.module_main import run_module

# ---- the command -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from kvmesh.testing.mesh import launched, mesh_config, random_prompts
    from kvmesh.testing.offline import offline_texts

    config = mesh_config(
        model=MODEL,
        prefill=args.prefill,
        decode=args.decode,
        transport="shm",
        decode_pacing_ms=args.decode_pacing_ms,
        draft=None if args.draft == "none" else args.draft,
        kv_store=args.kv_store,
        startup_timeout_s=300.0,
    )
    # half short prompts (prefilled on the decode worker), half long ones (the prefill queue)
    prompts = random_prompts(args.requests // 2, 16, 48, seed=args.seed)
    prompts += random_prompts(args.requests - len(prompts), 200, 400, seed=args.seed + 1)
    print(f"uptime: {os.popen('uptime').read().strip()}", flush=True)
    with launched(config) as mesh:  # kvmesh up's defaults (the tests' ENV has no kv-store)
        if args.scenario == "stalled-clients":
            stalled, normal = prompts[: args.stalled], prompts[-4:]
            result = asyncio.run(stalled_clients(mesh, stalled, 3000, normal, 64, args.outage_s))
            gaps = [o.worst_gap_s for o in result["normal"] if o is not None]
            errors = [o.error for o in result["normal"] if o is None or o.error]
            print(
                f"stalled-clients: {len(stalled)} stalled for {args.outage_s:g} s; "
                f"{len(gaps)} normal streams, worst token gap {max(gaps):.3f} s (median of "
                f"worst {statistics.median(gaps):.3f} s), {len(errors)} failed; /metrics worst "
                f"{max(result['metrics_s']):.3f} s; {result['cutoffs']:g} cut off by the router "
                f"before they closed; blocks back {result['blocks_back_s']} s after they closed"
            )
            return 0
        expected = offline_texts(prompts, args.max_tokens, model=MODEL)
        if args.scenario == "nats-outage":
            outcomes, back = asyncio.run(
                nats_outage(
                    mesh,
                    prompts[: len(prompts) - args.during],
                    args.max_tokens,
                    args.concurrency,
                    args.outage_s,
                    during=prompts[len(prompts) - args.during :],
                )
            )
        elif args.scenario == "registry-kill":
            outcomes, back = asyncio.run(registry_kill(mesh, prompts, args.max_tokens))
        elif args.scenario == "worker-kill":
            outcomes, back = asyncio.run(
                worker_kill(mesh, prompts, args.max_tokens, args.concurrency, args.worker)
            )
        else:
            outcomes, back = asyncio.run(
                decode_stop(mesh, prompts, args.max_tokens, args.concurrency, args.outage_s)
            )
    counts = tally(outcomes, expected)
    what = args.worker if args.scenario == "worker-kill" else f"{args.outage_s:g} s"
    print(f"{args.scenario} ({what}): {counts.summary()}; blocks back {back} s")
    return 0 if counts.right_share >= 0.95 and not counts.wrong and not counts.hung else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "scenario",
        choices=("nats-outage", "registry-kill", "worker-kill", "decode-stop", "stalled-clients"),
    )
    p.add_argument("--worker", default="decode-0", help="worker-kill: the service killed")
    p.add_argument(
        "--during",
        type=int,
        default=0,
        help="nats-outage: of --requests, this many are sent halfway through the outage",
    )
    p.add_argument("--outage-s", type=float, default=10.0, help="outage, stop or stall length")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--stalled", type=int, default=20, help="stalled-clients: clients that stall")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--decode-pacing-ms", type=float, default=0.0, help="kvmesh up's (0)")
    p.add_argument("--draft", choices=("ngram", "none"), default="ngram")
    p.add_argument("--kv-store", type=int, default=1)
    p.add_argument("--seed", type=int, default=33)


if __name__ == "__main__":
    run_module("fault_drill", __doc__, add_arguments, run)
