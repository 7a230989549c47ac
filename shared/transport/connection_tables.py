"""The receiving server's two bounded tables of connections (``server.SocketServer``'s).

``PendingHandshakes``: the handshakes in progress, in accept order, counted per source address;
which one a new connection pushes out (the source's oldest over ``max_pending_per_source``; over
``max_pending``, the oldest of a source holding at least its fair share) and which ones are late.
``AdmittedConnections``: the connections admitted after their hello, counted per declared peer
id, under ``max_connections`` and ``max_per_peer`` (thread-safe: the serving threads release).
Neither touches a socket: the server resets and closes.
"""

from __future__ import annotations

import socket
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvmesh.shared.transport.lane_auth import LaneHello


class Handshake(Protocol):
    """One connection's hello, parsed as its bytes arrive (``lane_auth.HelloReader``)."""

    def challenge(self) -> bytes:
        """Sent as soon as the connection is accepted (may be empty)."""
        ...

    def need(self) -> int:
        """Bytes wanted before the next step (> 0 until the hello is complete)."""
        ...

    def feed(self, data: bytes) -> LaneHello | None:
        """The admitted hello once complete; raises HelloRefused."""
        ...


@dataclass(slots=True)
class PendingHandshake:
    conn: socket.socket
    handshake: Handshake
    source: str
    deadline: float


class PendingHandshakes:
    """Handshakes in progress, oldest first, with each source's count."""

    def __init__(self, max_pending: int, max_pending_per_source: int) -> None:
        self.max_pending = max_pending
        self.max_pending_per_source = max_pending_per_source
        self._pending: OrderedDict[socket.socket, PendingHandshake] = OrderedDict()
        self._per_source: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def __iter__(self) -> Iterator[PendingHandshake]:
        return iter(self._pending.values())

    def oldest(self) -> PendingHandshake | None:
        return next(iter(self._pending.values()), None)

    def add(self, pending: PendingHandshake) -> None:
        self._pending[pending.conn] = pending
        self._per_source[pending.source] = self._per_source.get(pending.source, 0) + 1

    def remove(self, pending: PendingHandshake) -> None:
        self._pending.pop(pending.conn, None)
        left = self._per_source.get(pending.source, 1) - 1
        if left:
            self._per_source[pending.source] = left
        else:
            self._per_source.pop(pending.source, None)

    def over_source_limit(self, source: str) -> PendingHandshake | None:
        """The oldest handshake of ``source`` if a new one from it would pass its limit."""
        if self._per_source.get(source, 0) < self.max_pending_per_source:
            return None
        return next(p for p in self._pending.values() if p.source == source)

    def over_total_limit(self) -> PendingHandshake | None:
        """If a new handshake would pass ``max_pending``: the oldest handshake of a source holding
        at least the average share (one always does). A source with a handshake or two is not
        pushed out by a flood."""
        if len(self._pending) < self.max_pending:
            return None
        fair = len(self._pending) / max(1, len(self._per_source))
        return next(p for p in self._pending.values() if self._per_source[p.source] >= fair)

    def expired(self, now: float) -> PendingHandshake | None:
        """The oldest handshake if its deadline has passed."""
        first = self.oldest()
        return first if first is not None and first.deadline <= now else None


class AdmittedConnections:
    """Connections admitted after their hello, each with its peer id; their peak."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, str] = {}
        self._per_peer: dict[str, int] = {}
        self.num_accepted = 0
        self.peak = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    def snapshot(self) -> list[socket.socket]:
        with self._lock:
            return list(self._conns)

    def admit(self, conn: socket.socket, peer_id: str) -> str | None:
        """Admit ``conn``; or the limit it would pass, as a refusal reason."""
        with self._lock:
            if len(self._conns) >= self.max_connections:
                return "connection limit reached"
            if self._per_peer.get(peer_id, 0) >= self.max_per_peer:
                return "per-peer connection limit reached"
            self._conns[conn] = peer_id
            self._per_peer[peer_id] = self._per_peer.get(peer_id, 0) + 1
            self.num_accepted += 1
            self.peak = max(self.peak, len(self._conns))
            return None

    def release(self, conn: socket.socket) -> None:
        """Forget ``conn`` (a connection never admitted is ignored)."""
        with self._lock:
            peer_id = self._conns.pop(conn, None)
            if peer_id is not None:
                left = self._per_peer[peer_id] - 1
                if left:
                    self._per_peer[peer_id] = left
                else:
                    del self._per_peer[peer_id]
