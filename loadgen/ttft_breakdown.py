"""Where the first token's time went in one ``kvmesh bench serve`` run (pure: no I/O).

Two sources, both optional (a server that is not kvmesh has neither the first):

- per request, the stages a kvmesh router timed (``GET /v1/kvmesh/timings``, see
  ``services/router/timings.py``), joined to the benchmark's completed requests by response id;
  the client's TTFT minus the router's is the HTTP side ("client");
- per role, the CPU time its processes used during the run and the time their threads were
  runnable but waiting for a core (``proc_sched.py``).

Each stage's p50 and p99 are taken over the requests on their own (the p99 of a stage need not
belong to the request with the p99 TTFT); the mean of each stage adds up to the mean TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.loadgen.proc_sched import SchedTimes
from kvmesh.loadgen.serve_metrics import RequestRecord, percentile

# stage key in a router timing -> label (in TTFT order)
STAGE_LABELS = {
    "admission_s": "admission wait",
    "place_s": "placement",
    "prefill_queue_s": "prefill queue",
    "prefill_s": "prefill compute",
    "transfer_s": "exposed transfer",
    "admit_s": "decode admit",
    "relay_s": "relay/hops",
    "client_s": "client side",
}


@dataclass(frozen=True, slots=True)
class StageStats:
    mean_ms: float
    p50_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One run's breakdown: stage -> stats over ``num_requests`` joined requests (empty when the
    server gave no timings), and role -> CPU/wait over ``duration_s``."""

    num_requests: int
    num_local: int  # of those, prefilled on the decode (or colocated) worker
    stages: dict[str, StageStats]
    roles: dict[str, SchedTimes]
    duration_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests,
            "num_local_prefill": self.num_local,
            "stages_ms": {
                k: {"mean": s.mean_ms, "p50": s.p50_ms, "p99": s.p99_ms}
                for k, s in self.stages.items()
            },
            "roles": {
                r: {"cpu_s": t.cpu_s, "runnable_waiting_s": t.wait_s} for r, t in self.roles.items()
            },
            "duration_s": self.duration_s,
        }


def _stats(values: Sequence[float]) -> StageStats:
    return StageStats(
        math.fsum(values) / len(values) * 1e3,
        percentile(values, 50) * 1e3,
        percentile(values, 99) * 1e3,
    )


def build(
    records: Iterable[RequestRecord],
    timings: Sequence[Mapping[str, Any]] | None,
    roles: Mapping[str, SchedTimes],
    duration_s: float,
) -> Breakdown:
    by_id = {str(t.get("request_id")): t for t in timings or ()}
    joined = []
    for record in records:
        timing = by_id.get(record.response_id) if record.response_id else None
        if record.is_ok and record.ttft_s is not None and timing is not None:
            joined.append((record, timing))
    stages: dict[str, StageStats] = {}
    if joined:
        for key in STAGE_LABELS:
            if key == "client_s":
                values = [max(0.0, r.ttft_s - float(t["ttft_s"])) for r, t in joined]  # type: ignore[operator]
            else:
                values = [float(t.get(key, 0.0)) for _, t in joined]
            stages[key] = _stats(values)
    num_local = sum(1 for _, t in joined if t.get("local_prefill"))
    return Breakdown(len(joined), num_local, stages, dict(roles), duration_s)


def format_breakdown(label: str, b: Breakdown) -> str:
    lines = []
    if b.stages:
        lines.append(
            f"where the first token's time went ({label}, {b.num_requests} requests, "
            f"{b.num_local} prefilled locally; ms):"
        )
        lines.append(f"  {'stage':<18} {'mean':>9} {'p50':>9} {'p99':>9}")
        for key, stats in b.stages.items():
            lines.append(
                f"  {STAGE_LABELS[key]:<18} {stats.mean_ms:9.0f} {stats.p50_ms:9.0f} "
                f"{stats.p99_ms:9.0f}"
            )
    if b.roles and b.duration_s > 0:
        lines.append(
            f"CPU by role over {b.duration_s:.1f} s (cores' worth = seconds / run time; "
            "waiting = runnable, not running):"
        )
        for role, t in sorted(b.roles.items()):
            lines.append(
                f"  {role:<14} CPU {t.cpu_s:8.1f} s ({t.cpu_s / b.duration_s:4.2f} cores)   "
                f"waiting {t.wait_s:8.1f} s ({t.wait_s / b.duration_s:4.2f})"
            )
    return "\n".join(lines)
