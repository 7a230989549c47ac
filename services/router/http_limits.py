"""Limits on the router's HTTP connections: a client cannot hold the router with slow requests.

aiohttp reads headers for as long as the client keeps sending them and holds any number of
connections: 100 slowloris connections (a header byte now and then) stayed open for 30 s and
longer (issue 27). ``GuardedSite`` is aiohttp's ``TCPSite`` with each connection's protocol
wrapped in a ``ConnectionGuard``:

- a client (one peer address) may hold at most ``max_connections_per_client`` connections; more
  are closed at once, so one client cannot take the others' room;
- the router holds at most ``max_connections`` in all (issue 40: 1,100 idle keep-alive
  connections from 20 addresses ran it out of descriptors). A new connection over it closes the
  oldest one waiting for a request's headers (idle keep-alive or slow), or is closed itself when
  every connection is in a request;
- a request's headers must be complete within ``header_timeout_s`` of its first byte (of the
  connection's start, for its first request, and of the end of the request before, on a kept-
  alive connection): a connection that has not sent them is closed. The clock runs only while
  no request of the connection is in progress: a request whose headers were read before the one
  ahead of it ended (pipelined, or sent as soon as the client read the response's end) is not
  cut by a clock that the end of the one ahead started (issue 43: such streams were cut at 10 s);
- the body is read within ``body_timeout_s`` (``read_body``: a 408 after it), and one whose
  Content-Length is over ``--max-body-mb`` is refused (413) before any of it is read, on every
  route (``body_limit_middleware``).

Each refusal is counted (``kvmesh_router_http_refused_total{reason}``). ``AcceptErrorLog`` turns
the event loop's accept failures (EMFILE: out of descriptors) into one line a second with a count,
instead of a traceback per failed accept.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from kvmesh.services.router.config import HttpLimits
from kvmesh.services.router.errors import PayloadTooLargeError, RequestTimeoutError
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)

HEADERS_END = b"\r\n\r\n"
# what asyncio's selector loop says when accept() fails with EMFILE, ENFILE, ENOBUFS or ENOMEM
# (it then pauses that listener for a second and tries again)
ACCEPT_OUT_OF_RESOURCES = "socket.accept() out of system resource"


class ConnectionTable:
    """Open connections per client address, and the guard of each transport, oldest first (for
    the middleware that says when a request is done, and for making room under the cap)."""

    def __init__(self, limits: HttpLimits, on_refused: Callable[[str], None]) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self.per_client: Counter[str] = Counter()
        # admitted and not closed by the table; insertion order is connection age
        self.guards: dict[asyncio.BaseTransport, ConnectionGuard] = {}

    @property
    def num_open(self) -> int:
        return len(self.guards)

    def admit(self, client: str) -> bool:
        """Whether a new connection from ``client`` may stay. Under the global cap it always
        may (room is made by closing the oldest connection waiting for headers); over its
        client's cap, or with every connection in a request, it may not."""
        if self.per_client[client] >= self.limits.max_connections_per_client:
            self.on_refused("too_many_connections")
            return False
        if self.num_open >= self.limits.max_connections and not self._close_oldest_idle():
            self.on_refused("router_full")
            return False
        self.per_client[client] += 1
        return True

    def _close_oldest_idle(self) -> bool:
        for transport, guard in self.guards.items():
            if guard.waiting_headers:
                del self.guards[transport]  # its room counts at once; connection_lost follows
                self.on_refused("pushed_out")
                transport.abort()
                return True
        return False

    def release(self, client: str) -> None:
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]


class ConnectionGuard(asyncio.Protocol):
    """Wraps aiohttp's protocol for one connection: refuses it over the client's cap, closes it
    when a request's headers are not complete within ``header_timeout_s``."""

    def __init__(self, inner: asyncio.Protocol, table: ConnectionTable) -> None:
        self.inner = inner
        self.table = table
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.admitted = False
        self.waiting_headers = True
        self.tail = b""  # the last bytes seen while waiting for the end of the headers
        self.timer: asyncio.TimerHandle | None = None
        self.num_in_progress = 0  # requests whose handler runs (request_done_middleware's count)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if peer else "?"
        self.admitted = self.table.admit(self.client)
        if not self.admitted:
            transport.abort()  # nothing was read or parsed: no handler runs
            return
        self.table.guards[transport] = self
        self._await_headers()
        self.inner.connection_made(transport)

    def _await_headers(self) -> None:
        self.waiting_headers, self.tail = True, b""
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(self.table.limits.header_timeout_s, self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        if self.waiting_headers and self.num_in_progress == 0 and self.transport is not None:
            self.table.on_refused("header_timeout")
            self.transport.abort()

    def request_started(self) -> None:
        """The middleware's word: a request's handler runs; no header clock while it does."""
        self.num_in_progress += 1
        self.waiting_headers = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def request_done(self) -> None:
        """The middleware's word: a request's handler returned. With none left in progress the
        next request's clock starts; a request already read (pipelined) cancels it as soon as
        its handler starts."""
        assert self.num_in_progress > 0, "request_done without request_started"
        self.num_in_progress -= 1
        if self.num_in_progress > 0:
            return
        if self.transport is not None and not self.transport.is_closing():
            self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self.waiting_headers:
            seen = self.tail + data
            if HEADERS_END in seen:
                self.waiting_headers = False
                if self.timer is not None:
                    self.timer.cancel()
            else:
                self.tail = seen[-(len(HEADERS_END) - 1) :]
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if not self.admitted:
            return
        self.table.release(self.client)
        if self.transport is not None:
            self.table.guards.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class AcceptErrorLog:
    """The event loop's exception handler while the router serves: a failed accept (out of
    descriptors) is counted and logged at most once per ``interval_s``, with how many failed
    since the last line; any other context goes to the handler that was there before."""

    def __init__(
        self,
        on_refused: Callable[[str], None],
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_refused = on_refused
        self.interval_s = interval_s
        self.clock = clock
        self.num_unlogged = 0
        self.logged_at: float | None = None
        self.previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self.previous = loop.get_exception_handler()
        loop.set_exception_handler(self)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop.get_exception_handler() is self:
            loop.set_exception_handler(self.previous)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_OUT_OF_RESOURCES:
            if self.previous is not None:
                self.previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.on_refused("accept_failed")
        self.num_unlogged += 1
        now = self.clock()
        if self.logged_at is not None and now - self.logged_at < self.interval_s:
            return
        log.warning(
            "accepting HTTP connections fails; new clients wait in the backlog (raise the "
            "open-file limit, or lower --max-connections)",
            error=str(context.get("exception")),
            failed_accepts=self.num_unlogged,
        )
        self.logged_at, self.num_unlogged = now, 0


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through ``ConnectionGuard``s of ``table``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        table: ConnectionTable,
        *,
        reuse_port: bool = False,
    ):
        super().__init__(runner, host, port, reuse_port=reuse_port or None)
        self._table = table

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        table = self._table
        self._server = await asyncio.get_running_loop().create_server(
            lambda: ConnectionGuard(server(), table),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


def request_done_middleware(table: ConnectionTable) -> Callable:
    """Tell a connection's guard when each of its requests starts and is answered (keep-alive:
    the next request's header clock runs only while none is in progress, not while a handler
    streams). The outermost middleware, so that every request that reaches a handler counts."""

    @web.middleware
    async def done(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        guard = table.guards.get(request.transport) if request.transport else None
        if guard is None:
            return await handler(request)
        guard.request_started()
        try:
            return await handler(request)
        finally:
            guard.request_done()

    return done


def body_limit_middleware(max_bytes: int, on_refused: Callable[[str], None]) -> Callable:
    """Refuse, on every route, a request whose Content-Length is over ``max_bytes`` before a
    byte of its body is read (PayloadTooLargeError: a 413, and the connection closes). A body
    without one (chunked) is read up to ``max_bytes`` at most: aiohttp's ``client_max_size``,
    which must be the same, stops ``request.read()`` there."""

    @web.middleware
    async def check_size(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        size = request.content_length
        if size is not None and size > max_bytes:
            on_refused("body_too_large")
            raise PayloadTooLargeError(
                f"the request body is {size} bytes, more than this router accepts "
                f"({max_bytes}); raise --max-body-mb or send less"
            )
        return await handler(request)

    return check_size


async def read_body(
    request: web.Request, timeout_s: float, on_refused: Callable[[str], None]
) -> bytes:
    """The request's body, read within ``timeout_s`` (RequestTimeoutError, a 408, after it)."""
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except TimeoutError:
        on_refused("body_timeout")
        raise RequestTimeoutError(
            f"the request body did not arrive within {timeout_s:g}s (--body-timeout-s)"
        ) from None
