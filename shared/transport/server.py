"""The receiving side's listening socket: an accept loop that hands every connection to a
handler on its own daemon thread, and a close that stops accepting, shuts every live connection
down (unblocking its handler) and joins all the threads. Used by the shm and tcp backends."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable

from shared.transport.threads import ThreadSet


class SocketServer:
    def __init__(
        self,
        listener: socket.socket,
        handle: Callable[[socket.socket], None],
        name: str,
        on_accept: Callable[[socket.socket], None] | None = None,
    ) -> None:
        self.listener = listener  # bound and listening
        self._handle = handle  # serves one connection until it ends; the server closes it
        self._name = name
        self._on_accept = on_accept
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads = ThreadSet()
        self._closed = False

    def start(self) -> None:
        self._threads.spawn(self._accept_loop, f"{self._name}-accept")

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self._on_accept is not None:
                self._on_accept(conn)
            with self._lock:
                self._conns.add(conn)
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
