"""Which workers of one role are alive and ready, as the router hears them: pure, clock passed in.

Fed by heartbeats (``kvmesh.heartbeat.<role>.<id>``) and the registry's WorkerGone. The router
keeps two pools:
- prefill: when no prefill worker is ready, a prompt above the local-prefill threshold would wait
  in the queue until its timeout, so the router prefills it on the decode worker instead;
- decode (and colocated): ``/health`` is ready only while one is ready, and with none alive at
  all a request is a 503 ("no workers" is not "at capacity").
A worker that heartbeats ``starting`` (a decode worker loading its model) is alive but not ready.
One the registry announced gone is forgotten, except when it was last heard (``seen_within``):
a decode worker heard lately may be restarting (its supervisor brings it back), and requests
wait for it rather than fail. Until the router has listened for one liveness window it does not
know; callers say what to assume then. Silence counts only while the router is connected to NATS (``Hearing``): after an
outage, a worker is gone only once it has been silent for a whole window since the reconnect.
"""

from __future__ import annotations

from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.worker_state import WorkerState

MAX_GONE = 1024  # workers announced gone whose last heartbeat is remembered


class WorkerPool:
    def __init__(
        self, liveness_s: float, started_at: float, hearing: Hearing | None = None
    ) -> None:
        self.liveness_s = liveness_s
        self._started_at = started_at
        self._hearing = hearing or Hearing(connected_since=started_at)
        self._seen: dict[str, tuple[float, str]] = {}  # worker id -> (last heartbeat, state)
        self._gone: dict[str, float] = {}  # announced gone: worker id -> its last heartbeat

    def on_heartbeat(self, worker_id: str, state: str, now: float) -> None:
        self._seen[worker_id] = (now, state)
        self._gone.pop(worker_id, None)

    def on_gone(self, worker_id: str) -> None:
        seen = self._seen.pop(worker_id, None)
        if seen is not None:
            self._gone.pop(worker_id, None)
            self._gone[worker_id] = seen[0]
            if len(self._gone) > MAX_GONE:  # bounded: the oldest go first
                del self._gone[next(iter(self._gone))]

    def is_known(self, now: float) -> bool:
        """Whether the router has listened long enough to have heard every live worker."""
        return self._hearing.silence(self._started_at, now) >= self.liveness_s

    def seen_within(self, now: float, window_s: float) -> bool:
        """Whether any worker of the pool heartbeat in the last ``window_s`` seconds (one
        announced gone since included)."""
        heard = [seen for seen, _ in self._seen.values()] + list(self._gone.values())
        return any(self._hearing.silence(seen, now) <= window_s for seen in heard)

    def starting(self, now: float) -> list[str]:
        """Alive workers that heartbeat ``starting`` (loading), by id."""
        return sorted(
            w
            for w, (seen, state) in self._seen.items()
            if state == WorkerState.STARTING and self._is_alive(seen, now)
        )

    def num_alive(self, now: float) -> int:
        return sum(self._is_alive(seen, now) for seen, _ in self._seen.values())

    def num_ready(self, now: float) -> int:
        """Alive and taking new work (not draining)."""
        return sum(
            self._is_alive(seen, now) and state == WorkerState.READY
            for seen, state in self._seen.values()
        )

    def silent(self, now: float) -> list[str]:
        """Workers heard once and silent for longer than the liveness window now, by id (a
        worker the registry announced gone is forgotten by ``on_gone``)."""
        return sorted(w for w, (seen, _) in self._seen.items() if not self._is_alive(seen, now))

    def _is_alive(self, seen: float, now: float) -> bool:
        return self._hearing.silence(seen, now) <= self.liveness_s
