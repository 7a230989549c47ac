"""How long a peer has been silent, counting only the time this process could hear it.

Every liveness check in the mesh is "silent for longer than a timeout": the kv-registry drops a
worker after ``--missed-heartbeats`` intervals, the router counts a worker gone after
``--worker-liveness-s``. While this process is cut off from NATS (the server restarting, its
own link down) it hears nobody, and silence then says nothing about the peers. So ``Hearing``
stops the silence clock while disconnected and restarts it at the reconnect: a peer counts as
silent only from ``max(its last message, the reconnect)``, and a worker is dead only after a
whole timeout of silence heard with the connection up.

Pure, clock passed in: the service's NATS callbacks call ``on_disconnected`` and
``on_reconnected`` (``shared/bus/nats_connect.connect_nats(hearing=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Hearing:
    """Whether this process can hear its peers now, and since when."""

    connected_since: float | None = 0.0  # None: disconnected now
    num_outages: int = 0
    disconnected_at: float = 0.0  # of the last outage
    last_outage_s: float = 0.0  # how long the last outage that ended lasted

    @property
    def is_connected(self) -> bool:
        return self.connected_since is not None

    def on_disconnected(self, now: float) -> None:
        if self.connected_since is not None:
            self.num_outages += 1
            self.disconnected_at = now
        self.connected_since = None

    def on_reconnected(self, now: float) -> None:
        if self.connected_since is None:
            self.last_outage_s = max(0.0, now - self.disconnected_at)
        self.connected_since = now

    def silence(self, last_heard: float, now: float) -> float:
        """Seconds a peer last heard at ``last_heard`` has been silent while this process could
        hear it: 0 while disconnected, else counted from the later of its last message and the
        reconnect."""
        if self.connected_since is None:
            return 0.0
        return max(0.0, now - max(last_heard, self.connected_since))
