"""``kvmesh bench gc``: what a full garbage collection costs a serving process, with its start-up
heap as ``kvmesh serve`` leaves it (frozen, ``kvmesh.commands.serve.frozen_heap``) against the
same heap unfrozen, measured in the same run.

The process builds a worker's heap (the decode service's imports and ``--model`` loaded), adds
``--live-objects`` objects that serving would keep (request state), then times ``gc.collect()``
``--repeats`` times each way. A full collection stops the event loop: every stream's next token
waits for it.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import orjson


def register_gc(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("gc", help="a full garbage collection's pause: start-up heap frozen vs not")
    p.add_argument("--model", default="kvmesh-tiny", help="the model whose heap to build")
    p.add_argument(
        "--live-objects", type=int, default=20_000, help="objects serving keeps alive (dicts)"
    )
    p.add_argument("--repeats", type=int, default=5, help="timed collections each way")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.set_defaults(func=run)
    return p


def _collect_ms(repeats: int) -> list[float]:
    took = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        took.append((time.perf_counter() - started) * 1e3)
    return took


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.live_objects < 0:
        print("kvmesh bench gc: --repeats must be >= 1 and --live-objects >= 0", file=sys.stderr)
        return 2
    import kvmesh.services.decode.service  # noqa: F401  (a decode worker's imports)
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.model_ref import model_path

    from kvmesh.commands.serve import frozen_heap

    model = load_model(model_path(args.model, "kvmesh bench gc"))  # noqa: F841  (kept alive)
    start_up = len(gc.get_objects())
    with frozen_heap():
        live = [{"request_id": f"r{i}", "token_ids": [i]} for i in range(args.live_objects)]
        frozen_ms = _collect_ms(args.repeats)
    unfrozen_ms = _collect_ms(args.repeats)  # the same heap, live objects included
    del live
    unfrozen, frozen = statistics.median(unfrozen_ms), statistics.median(frozen_ms)
    result = {
        "model": args.model,
        "start_up_objects": start_up,
        "live_objects": args.live_objects,
        "unfrozen_ms": round(unfrozen, 3),
        "frozen_ms": round(frozen, 3),
        "ratio": round(unfrozen / max(frozen, 1e-6), 1),
    }
    if args.json:
        print(orjson.dumps(result).decode())
        return 0
    print(
        f"a full collection with {start_up:,} start-up objects and {args.live_objects:,} live "
        f"ones ({args.model}), median of {args.repeats}:\n"
        f"  start-up heap unfrozen: {result['unfrozen_ms']:.2f} ms\n"
        f"  start-up heap frozen (kvmesh serve): {result['frozen_ms']:.2f} ms\n"
        f"  unfrozen / frozen: {result['ratio']:g}x"
    )
    return 0
