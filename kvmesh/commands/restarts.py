"""When `kvmesh up` restarts a service that died: exponential backoff within a budget.

Pure and clock-free: the launcher passes the time. A child that dies is restarted after 1 s,
then 2, 4, ... up to ``max_delay_s``; more than ``max_restarts`` deaths of one child within
``window_s`` means it cannot stay up (a bad flag, a port taken, a model it cannot load), and
the launcher stops the mesh with that child's exit code instead of looping. An optional service
(a kv-store, a draft worker: the mesh serves without them, only slower) that cannot stay up is
left down instead, and the mesh goes on degraded (issue 43: a kv-store whose disk was full
stopped a mesh that had served every request without it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# the tiers (up_config.TIERS) the mesh serves without: their requests go on, uncached or
# undrafted
OPTIONAL_TIERS = frozenset({"kv-store", "draft"})


@dataclass(frozen=True, slots=True)
class Restart:
    """Start the child again after ``delay_s``."""

    delay_s: float


@dataclass(frozen=True, slots=True)
class LeaveDown:
    """An optional child died ``num_deaths`` times within the window: the mesh goes on without
    it."""

    num_deaths: int


@dataclass(frozen=True, slots=True)
class StopMesh:
    """A child the mesh needs died ``num_deaths`` times within the window."""

    num_deaths: int


@dataclass(slots=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 300.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    _deaths: dict[str, deque[float]] = field(default_factory=dict)

    def on_exit(self, name: str, now: float) -> float | None:
        """``name`` died at ``now``: seconds to wait before restarting it, or None to give up."""
        deaths = self._deaths.setdefault(name, deque())
        while deaths and now - deaths[0] > self.window_s:
            deaths.popleft()
        deaths.append(now)
        if len(deaths) > self.max_restarts:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2 ** (len(deaths) - 1))

    def after_death(self, name: str, tier: str, now: float) -> Restart | LeaveDown | StopMesh:
        """What to do about child ``name`` of ``tier`` that died at ``now``."""
        delay = self.on_exit(name, now)
        if delay is not None:
            return Restart(delay)
        if tier in OPTIONAL_TIERS:
            return LeaveDown(self.restarts(name))
        return StopMesh(self.restarts(name))

    def restarts(self, name: str) -> int:
        """Deaths of ``name`` within the current window."""
        return len(self._deaths.get(name, ()))
