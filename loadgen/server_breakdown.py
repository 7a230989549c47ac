"""Where a kvmesh router says the time went during a run: its ``/metrics`` before and after.

The client sees time to first token as one number. A kvmesh router also knows its parts: how
long requests waited to be placed (admission queue, a full decode pool), how long prefill jobs
waited for a prefill worker, how long the prefill itself computed, and the KV transfer time
that compute did not hide. ``ServerBreakdown.between`` takes two scrapes (the counters are
cumulative over the router's life) and gives the means over the requests in between. Any other
server has no such metrics; the breakdown is then absent, not zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "kvmesh_router_"

Scrape = Mapping[str, float]


def _mean(before: Scrape, after: Scrape, metric: str) -> tuple[float | None, int]:
    """Mean of histogram ``metric`` over the observations made between the scrapes."""
    count = after.get(f"{PREFIX}{metric}_count", 0.0) - before.get(f"{PREFIX}{metric}_count", 0.0)
    total = after.get(f"{PREFIX}{metric}_sum", 0.0) - before.get(f"{PREFIX}{metric}_sum", 0.0)
    if count <= 0:
        return None, 0
    return total / count, int(count)


@dataclass(frozen=True, slots=True)
class ServerBreakdown:
    """Means in seconds over one run; a prefill figure is None when no job ran remotely."""

    requests: int  # first tokens the router timed
    ttft_s: float | None
    place_s: float | None  # arrival to placement
    prefill_jobs: int
    prefill_queue_s: float | None  # job published to a prefill worker taking it
    prefill_compute_s: float | None
    exposed_transfer_s: float | None  # KV transfer time not hidden behind compute

    @classmethod
    def between(cls, before: Scrape, after: Scrape) -> ServerBreakdown | None:
        if f"{PREFIX}time_to_first_token_seconds_count" not in after:
            return None  # not a kvmesh router
        ttft, requests = _mean(before, after, "time_to_first_token_seconds")
        place, _ = _mean(before, after, "place_seconds")
        queue, jobs = _mean(before, after, "prefill_queue_seconds")
        compute, _ = _mean(before, after, "prefill_compute_seconds")
        exposed, _ = _mean(before, after, "kv_exposed_transfer_seconds")
        return cls(requests, ttft, place, jobs, queue, compute, exposed)

    def line(self) -> str:
        def s(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f} s"

        text = (
            f"server side (router /metrics, means): TTFT {s(self.ttft_s)} over "
            f"{self.requests} requests; placement wait {s(self.place_s)}"
        )
        if self.prefill_jobs:
            text += (
                f"; {self.prefill_jobs} remote prefills: queue {s(self.prefill_queue_s)}, "
                f"compute {s(self.prefill_compute_s)}, exposed KV transfer "
                f"{s(self.exposed_transfer_s)}"
            )
        return text
