"""The receiving side's listening socket: an accept loop that hands every connection to a
handler on its own daemon thread, and a close that stops accepting, shuts every live connection
down (unblocking its handler) and joins all the threads. Used by the shm and tcp backends.

Bounded (a local attacker must not exhaust it): at most ``max_connections`` at once (more are
closed on accept and counted); every connection starts with ``handshake_timeout_s`` on its
socket, which the handler lifts (``settimeout(None)``) once the peer's hello is complete, so a
silent or half-finished hello is dropped; the accept loop outlives EMFILE and friends (it backs
off and retries) and ends only when the server closes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
import time
from collections.abc import Callable

from kvmesh.shared import logs
from kvmesh.shared.transport.threads import ThreadSet

log = logs.get_logger(__name__)

# accept() errors that mean "no resources right now", not "the listener is gone"
_TRANSIENT = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED}


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


class SocketServer:
    def __init__(
        self,
        listener: socket.socket,
        handle: Callable[[socket.socket], None],
        name: str,
        on_accept: Callable[[socket.socket], None] | None = None,
        *,
        max_connections: int = 256,
        handshake_timeout_s: float = 5.0,
    ) -> None:
        self.listener = listener  # bound and listening
        self._handle = handle  # serves one connection until it ends; the server closes it
        self._name = name
        self._on_accept = on_accept
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads = ThreadSet()
        self._closed = False
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.num_accepted = 0
        self.peak_connections = 0
        self.num_refused = 0  # connections closed at accept: over max_connections
        self.num_accept_errors = 0  # transient accept failures (EMFILE, ...) survived

    def start(self) -> None:
        self._threads.spawn(self._accept_loop, f"{self._name}-accept")

    @property
    def num_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError as exc:
                if self._closed or exc.errno not in _TRANSIENT:
                    return  # the listener was closed
                self.num_accept_errors += 1
                if logs.is_sampled(self.num_accept_errors):
                    log.warning("accept failed; retrying", server=self._name, error=str(exc))
                time.sleep(0.05)  # let descriptors free up
                continue
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
                    self.num_accepted += 1
                    self.peak_connections = max(self.peak_connections, len(self._conns))
            if full:
                self.num_refused += 1
                if logs.is_sampled(self.num_refused):
                    log.warning(
                        "connection refused: limit reached",
                        server=self._name,
                        max_connections=self.max_connections,
                        refused=self.num_refused,
                    )
                with contextlib.suppress(OSError):
                    conn.close()
                continue
            conn.settimeout(self.handshake_timeout_s)  # the handler lifts it after the hello
            if self._on_accept is not None:
                self._on_accept(conn)
            self._threads.spawn(self._serve, self._name, conn)

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._handle(conn)
        finally:
            with self._lock:
                self._conns.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()

    async def aclose(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        await asyncio.to_thread(self._threads.join)
