"""Limits on the router's HTTP connections: a client cannot hold the router with slow requests.

aiohttp reads headers for as long as the client keeps sending them and holds any number of
connections: 100 slowloris connections (a header byte now and then) stayed open for 30 s and
longer (issue 27). ``GuardedSite`` is aiohttp's ``TCPSite`` with each connection's protocol
wrapped in a ``ConnectionGuard``:

- a client (one peer address) may hold at most ``max_connections_per_client`` connections; more
  are closed at once, so one client cannot take the others' room;
- a request's headers must be complete within ``header_timeout_s`` of its first byte (of the
  connection's start, for its first request, and of the end of the request before, on a kept-
  alive connection): a connection that has not sent them is closed;
- the body is read within ``body_timeout_s`` (``read_body``: a 408 after it).

Each refusal is counted (``kvmesh_router_http_refused_total{reason}``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from aiohttp import web
from kvmesh.services.router.config import HttpLimits
from kvmesh.services.router.errors import RequestTimeoutError

HEADERS_END = b"\r\n\r\n"


class ConnectionTable:
    """Open connections per client address, and the guard of each transport (for the
    middleware that says when a request is done)."""

    def __init__(self, limits: HttpLimits, on_refused: Callable[[str], None]) -> None:
        self.limits = limits
        self.on_refused = on_refused
        self.per_client: Counter[str] = Counter()
        self.guards: dict[asyncio.BaseTransport, ConnectionGuard] = {}

    def admit(self, client: str) -> bool:
        if self.per_client[client] >= self.limits.max_connections_per_client:
            self.on_refused("too_many_connections")
            return False
        self.per_client[client] += 1
        return True

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
        if self.waiting_headers and self.transport is not None:
            self.table.on_refused("header_timeout")
            self.transport.abort()

    def request_done(self) -> None:
        """The middleware's word: the response went out; the next request's clock starts."""
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


class GuardedSite(web.TCPSite):
    """``web.TCPSite`` whose connections go through ``ConnectionGuard``s of ``table``."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, table: ConnectionTable):
        super().__init__(runner, host, port)
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
    """Tell a connection's guard when each of its requests is answered (keep-alive: the next
    request's header clock starts then, not while the handler streams)."""

    @web.middleware
    async def done(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        finally:
            guard = table.guards.get(request.transport) if request.transport else None
            if guard is not None:
                guard.request_done()

    return done


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
