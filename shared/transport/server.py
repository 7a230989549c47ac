"""The receiving side's listening socket: handshakes first, then one thread per admitted
connection. Used by the shm and tcp backends.

A local user must not be able to exhaust it (issue #27). So:

* a connection holds no thread until its hello is complete and admitted. One thread accepts
  connections and runs every pending handshake (``Handshake``: tcp's HMAC proof, shm's hello)
  over non-blocking sockets with a selector;
* each loop round first reads the handshakes that have bytes, then accepts at most
  ``max_accepts_per_round`` connections: a flood in the backlog cannot starve the hellos
  already pending (issue 40: the loop drained the backlog first, and a real writer's hello
  waited behind 20k connections a second);
* per source address (``source_budget``): accepts per second are budgeted, and a source whose
  lanes had too many accesses refused is blocked for a while; a connection over its source's
  budget, or from a blocked source, is reset at accept. A refused hello does not block its
  source: without the secret it guesses nothing (256 bits), and counting it would let any
  local user block the address an honest writer shares with it;
* at most ``max_pending`` handshakes at once, and ``max_pending_per_source`` from one source
  address: a new connection over the source's limit pushes out that source's oldest pending
  one; over the total, the oldest pending one of a source holding at least its fair share
  (``max_pending`` / sources), so a flood of silent connections from many addresses cannot
  push out a real peer's hello (one round trip) before it completes;
* a handshake not complete within ``handshake_timeout_s`` is dropped;
* admitted connections: at most ``max_connections`` in all and ``max_per_peer`` per declared
  peer id, each served by its own daemon thread;
* every refusal looks alike to the peer: the connection is closed, nothing is said (a bad proof,
  a malformed hello, a full server, a timeout); the counters and the log say which;
* the accept loop outlives EMFILE and friends (it backs off and retries) and ends only when the
  server closes;
* a server may listen on a second socket (``add_listener``: tcp's same-host unix socket) under
  the same limits; each connection from it is first put to that socket's peer check (the
  peer's uid, ``unix_lanes``) and reset, before any byte, if refused. Those skip the
  per-source accept budget (one source: the users the check lets in).

The two tables (handshakes pending, connections admitted) and their limits: connection_tables.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.shared.obs import logs
from kvmesh.shared.transport.connection_tables import (
    AdmittedConnections,
    Handshake,
    PendingHandshake,
    PendingHandshakes,
)
from kvmesh.shared.transport.lane_auth import HelloRefused, LaneHello
from kvmesh.shared.transport.source_budget import BudgetVerdict, SourceGuard, source_of
from kvmesh.shared.transport.threads import ThreadSet

log = logs.get_logger(__name__)

# accept() errors that mean "no resources right now", not "the listener is gone"
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}
_TICK_S = 0.1  # the handshake thread's longest sleep (it also checks for close)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill ``view`` from ``sock``; returns the bytes received (short only on EOF). Also right
    under a socket timeout, where a single MSG_WAITALL read may return early."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if r == 0:
            break
        got += r
    return got


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_connections: int = 256  # admitted connections, in all
    max_per_peer: int = 32  # admitted connections with one declared peer id
    max_pending: int = 1024  # handshakes in progress, in all
    max_pending_per_source: int = 256  # handshakes in progress from one source address
    handshake_timeout_s: float = 5.0
    max_accepts_per_round: int = 64  # accepted between two reads of the pending handshakes


class SocketServer:
    def __init__(
        self,
        listener: socket.socket,
        handle: Callable[[socket.socket, LaneHello], None],
        name: str,
        handshake: Callable[[], Handshake],
        *,
        on_admit: Callable[[socket.socket], None] | None = None,
        accept_reply: bytes = b"",
        limits: ServerLimits | None = None,
        guard: SourceGuard | None = None,
    ) -> None:
        self.listener = listener  # bound and listening
        self._handle = handle  # serves one admitted connection until it ends; the server closes it
        self._name = name
        self._new_handshake = handshake
        self._on_admit = on_admit
        self._accept_reply = accept_reply
        self.limits = limits or ServerLimits()
        # per-source accepts and refusals, shared with the lanes (None: one source, e.g. shm's
        # unix socket in its owner's directory)
        self.guard = guard
        limits = self.limits
        self._conns = AdmittedConnections(limits.max_connections, limits.max_per_peer)
        self._pending = PendingHandshakes(limits.max_pending, limits.max_pending_per_source)
        self._threads = ThreadSet()
        # each listening socket -> its peer check (a refusal reason, or None to go on); the
        # first listener has none: its connections are budgeted by source (``guard``)
        self._listeners: dict[socket.socket, Callable[[socket.socket], str | None] | None] = {
            listener: None
        }
        self._selector = selectors.DefaultSelector()
        self._closed = False
        self._loop_done = threading.Event()
        self._started = False
        self.num_refused = 0  # closed before admission: bad hello, timeout, pushed out, full
        self.num_throttled = 0  # reset at accept: over its source's budget, or blocked
        self.num_accept_errors = 0  # transient accept failures (EMFILE, ...) survived

    def add_listener(
        self, listener: socket.socket, check_peer: Callable[[socket.socket], str | None]
    ) -> None:
        """Accept from ``listener`` too (bound and listening), under the same limits; each
        connection is reset at accept if ``check_peer`` gives a reason. Before ``start``."""
        assert not self._started, "add listeners before start()"
        self._listeners[listener] = check_peer

    def start(self) -> None:
        self._started = True
        for listener in self._listeners:
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ)
        self._threads.spawn(self._loop, f"{self._name}-accept")

    @property
    def num_connections(self) -> int:
        """Admitted connections (each holds a thread)."""
        return len(self._conns)

    @property
    def num_accepted(self) -> int:
        """Connections admitted after their hello, since the start."""
        return self._conns.num_accepted

    @property
    def peak_connections(self) -> int:
        return self._conns.peak

    @property
    def num_pending(self) -> int:
        """Connections whose handshake is in progress (they hold no thread)."""
        return len(self._pending)

    # -- the handshake thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closed:
                self._tick()
        finally:
            for pending in list(self._pending):
                self._drop(pending, "")
            with contextlib.suppress(Exception):
                self._selector.close()
            self._loop_done.set()

    def _tick(self) -> None:
        """One round: advance the handshakes that have bytes, then accept a bounded number of
        new connections, then expire the late handshakes."""
        timeout = _TICK_S
        first = self._pending.oldest()
        if first is not None:
            timeout = min(timeout, max(0.0, first.deadline - time.monotonic()))
        try:
            ready = []
            for key, _ in self._selector.select(timeout):
                if key.data is None:  # a listener
                    ready.append(key.fileobj)
                else:
                    self._advance(key.data)
            for listener in ready:
                self._accept_some(listener, self.limits.max_accepts_per_round)
            self._expire(time.monotonic())
        except Exception as exc:  # a bug must not end the receiver's accepting
            log.exception("handshake loop error; going on", server=self._name, error=str(exc))
            time.sleep(_TICK_S)

    def _accept_some(self, listener: socket.socket, max_accepts: int) -> None:
        check_peer = self._listeners[listener]
        for _ in range(max_accepts):
            if self._closed:
                return
            try:
                conn, address = listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self._closed or exc.errno not in _TRANSIENT:
                    self._closed = True  # the listener is gone
                    return
                self.num_accept_errors += 1
                if logs.is_sampled(self.num_accept_errors):
                    log.warning("accept failed; retrying", server=self._name, error=str(exc))
                time.sleep(0.05)  # let descriptors free up
                return
            source = source_of(address)
            if check_peer is not None:
                if self._peer_refused(conn, source, check_peer):
                    continue
                self._start_handshake(conn, source)
                continue
            verdict = BudgetVerdict.ADMIT if self.guard is None else self.guard.admit(source)
            if verdict is BudgetVerdict.ADMIT:
                self._start_handshake(conn, source)
                continue
            self.num_throttled += 1  # reset before any byte: no challenge, no nonce, no slot
            if logs.is_sampled(self.num_throttled):
                log.warning(
                    "connection reset at accept",
                    server=self._name,
                    reason=verdict.value,
                    source=source,
                    throttled_total=self.num_throttled,
                )
            _reset(conn)

    def _peer_refused(
        self, conn: socket.socket, source: str, check_peer: Callable[[socket.socket], str | None]
    ) -> bool:
        """Reset ``conn`` (before any byte) if its listener's peer check refuses it."""
        try:
            reason = check_peer(conn)
        except OSError as exc:
            reason = f"peer check failed: {exc}"
        if reason is None:
            return False
        self._count_refused(reason, source)
        _reset(conn)
        return True

    def _make_room(self, source: str) -> None:
        """Push out one pending handshake if ``source`` or the server is at its limit."""
        oldest = self._pending.over_source_limit(source)
        if oldest is not None:
            self._drop(oldest, "pushed out by a newer handshake from its source")
        victim = self._pending.over_total_limit()
        if victim is not None:
            self._drop(victim, "pushed out by a newer handshake")

    def _start_handshake(self, conn: socket.socket, source: str) -> None:
        self._make_room(source)
        conn.setblocking(False)
        handshake = self._new_handshake()
        deadline = time.monotonic() + self.limits.handshake_timeout_s
        pending = PendingHandshake(conn, handshake, source, deadline)
        self._pending.add(pending)
        try:
            greeting = handshake.challenge()
            if greeting and conn.send(greeting) != len(greeting):
                raise OSError("short send of the challenge")
            self._selector.register(conn, selectors.EVENT_READ, pending)
        except OSError:
            self._drop(pending, "")

    def _advance(self, pending: PendingHandshake) -> None:
        try:
            data = pending.conn.recv(pending.handshake.need())
            if not data:
                self._drop(pending, "")
                return
            hello = pending.handshake.feed(data)
        except BlockingIOError:
            return
        except OSError:
            self._drop(pending, "")
            return
        except HelloRefused as exc:
            self._drop(pending, str(exc))
            return
        if hello is not None:
            self._admit(pending, hello)

    def _expire(self, now: float) -> None:
        while (late := self._pending.expired(now)) is not None:
            self._drop(late, "hello not complete in time")

    def _forget(self, pending: PendingHandshake) -> None:
        self._pending.remove(pending)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(pending.conn)

    def _drop(self, pending: PendingHandshake, reason: str) -> None:
        """Refuse a connection before admission: reset it, say nothing (no oracle)."""
        self._forget(pending)
        if reason:  # counted before the reset: a peer that saw the reset sees it counted
            self._count_refused(reason, pending.source)
        _reset(pending.conn)

    def _count_refused(self, reason: str, source: str) -> None:
        self.num_refused += 1
        if logs.is_sampled(self.num_refused):
            log.warning(
                "connection refused",
                server=self._name,
                reason=reason,
                source=source,
                refused_total=self.num_refused,
            )

    def _admit(self, pending: PendingHandshake, hello: LaneHello) -> None:
        self._forget(pending)
        conn = pending.conn
        refusal = self._conns.admit(conn, hello.peer_id)
        if refusal is not None:
            self._count_refused(refusal, pending.source)
            _reset(conn)
            return
        try:
            conn.setblocking(True)
            if self._accept_reply:
                conn.settimeout(self.limits.handshake_timeout_s)
                conn.sendall(self._accept_reply)
                conn.settimeout(None)
            if self._on_admit is not None:
                self._on_admit(conn)
        except OSError:
            self._release(conn)
            return
        self._threads.spawn(self._serve, self._name, conn, hello)

    def _release(self, conn: socket.socket) -> None:
        self._conns.release(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def _serve(self, conn: socket.socket, hello: LaneHello) -> None:
        try:
            self._handle(conn, hello)
        finally:
            self._release(conn)

    async def aclose(self) -> None:
        self._closed = True
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
        if self._started:  # the handshake thread ends within a tick
            await asyncio.to_thread(self._loop_done.wait)
        for listener in self._listeners:
            listener.close()
        for conn in self._conns.snapshot():
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        await asyncio.to_thread(self._threads.join)


_LINGER_RESET = struct.pack("ii", 1, 0)


def _reset(conn: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): every refusal ends the same way, whether or not the
    peer's bytes were all read (a plain close resets only when some were not: an oracle), and
    leaves no TIME_WAIT behind."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    with contextlib.suppress(OSError):
        conn.close()


__all__ = ["Handshake", "ServerLimits", "SocketServer", "recv_exact"]
