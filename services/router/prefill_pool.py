"""Which prefill workers are alive, as the router sees them: pure, the clock passed in.

Fed by prefill heartbeats (``kvmesh.heartbeat.prefill.<id>``) and the registry's WorkerGone.
When no prefill worker is alive, a prompt above the local-prefill threshold would wait in the
prefill queue until its timeout, so the router prefills it on the decode worker instead
(degraded, but served). Until the router has listened for one liveness window it does not know,
and assumes the pool is there (the usual case at start-up).
"""

from __future__ import annotations


class PrefillPool:
    def __init__(self, liveness_s: float, started_at: float) -> None:
        self.liveness_s = liveness_s
        self._started_at = started_at
        self._last_seen: dict[str, float] = {}  # ready prefill workers only

    def on_heartbeat(self, worker_id: str, state: str, now: float) -> None:
        if state == "ready":
            self._last_seen[worker_id] = now
        else:  # draining: it takes no new job
            self._last_seen.pop(worker_id, None)

    def on_gone(self, worker_id: str) -> None:
        self._last_seen.pop(worker_id, None)

    def num_alive(self, now: float) -> int:
        return sum(now - seen <= self.liveness_s for seen in self._last_seen.values())

    def has_workers(self, now: float) -> bool:
        """False only when the router knows no prefill worker is alive."""
        if now - self._started_at < self.liveness_s:
            return True  # not listened long enough to know
        return self.num_alive(now) > 0
