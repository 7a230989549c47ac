"""When `kvmesh up` restarts a service that died: exponential backoff within a budget.

Pure and clock-free: the launcher passes the time. A child that dies is restarted after 1 s,
then 2, 4, ... up to ``max_delay_s``; more than ``max_restarts`` deaths of one child within
``window_s`` means it cannot stay up (a bad flag, a port taken, a model it cannot load), and
the launcher stops the mesh with that child's exit code instead of looping.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


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

    def restarts(self, name: str) -> int:
        """Deaths of ``name`` within the current window."""
        return len(self._deaths.get(name, ()))
