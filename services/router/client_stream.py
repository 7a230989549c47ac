"""The bytes of one SSE response on their way to its client, bounded in memory and in time.

The relay hands each event to ``ClientStream.send``, which never waits: the bytes go into the
stream's send buffer, and a writer task of its own moves them into the HTTP response. A client
that reads slowly or not at all therefore holds up only that writer, never the relay, the event
loop, the heartbeats or ``/metrics``; and the router holds at most ``max_buffer_bytes`` for it
(queued here and in aiohttp's transport together), plus up to 64 KiB in the socket's send
buffer (SO_SNDBUF, which the kernel doubles). It is cut off, with a
``ClientGoneError`` the relay sees at its next send, when

- the send buffer would grow past ``max_buffer_bytes`` (the client reads slower than the mesh
  writes), or
- one write into the response waits longer than ``write_timeout_s`` (the client stopped reading:
  the socket's buffers are full).

Then the caller aborts the request's mesh work (its blocks come back) and drops the connection.
A client that went away (a reset) is the same error with another reason. ``SendBuffer`` is the
pure part: what is queued and whether one more chunk fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web
from kvmesh.services.router.errors import ClientGoneError
from kvmesh.shared.obs import logs

log = logs.get_logger(__name__)

# The socket's send buffer, at most (the kernel doubles it): the send buffer proper is ours
MAX_SOCKET_BUFFER_BYTES = 64 * 1024
BUFFER_FULL = "send buffer full"
WRITE_TIMEOUT = "write timeout"


@dataclass(slots=True)
class SendBuffer:
    """Chunks not yet handed to the HTTP response, at most ``max_bytes`` of them."""

    max_bytes: int
    chunks: deque[bytes] = field(default_factory=deque)
    num_bytes: int = 0

    def push(self, chunk: bytes, num_sent_unread: int = 0) -> bool:
        """Queue ``chunk``; False (nothing queued) when it would pass ``max_bytes`` with the
        ``num_sent_unread`` bytes handed on but still waiting in the transport."""
        if num_sent_unread + self.num_bytes + len(chunk) > self.max_bytes:
            return False
        self.chunks.append(chunk)
        self.num_bytes += len(chunk)
        return True

    def take(self) -> bytes:
        """Everything queued, as one write (b"" when empty)."""
        data = b"".join(self.chunks)
        self.chunks.clear()
        self.num_bytes = 0
        return data


class ClientStream:
    """One prepared SSE response with a bounded send buffer and a write timeout; an async
    context manager (the writer task lives inside it)."""

    def __init__(
        self,
        http: web.Request,
        response: web.StreamResponse,
        *,
        max_buffer_bytes: int,
        write_timeout_s: float,
    ) -> None:
        self._http = http
        self._response = response
        self._buffer = SendBuffer(max_buffer_bytes)
        self._write_timeout_s = write_timeout_s
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and no write under way
        self._idle.set()
        self._writer: asyncio.Task[None] | None = None
        self.error: ClientGoneError | None = None  # set once the client is cut off or gone

    async def __aenter__(self) -> ClientStream:
        transport = self._http.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            # The kernel's share of the bound: left alone, loopback autotunes a socket's send
            # buffer to megabytes, which a stalled client at a few KB/s would take minutes to fill.
            size = min(self._buffer.max_bytes, MAX_SOCKET_BUFFER_BYTES)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        self._writer = asyncio.create_task(self._write_loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._writer is not None
        self._writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._writer
        if self.error is not None:
            self.drop_connection()

    def send(self, data: bytes) -> None:
        """Queue ``data`` for the client without waiting; ClientGoneError once it is cut off."""
        transport = self._http.transport
        # aiohttp waits for the transport to drain only every 64 KiB: what it holds counts too
        held = transport.get_write_buffer_size() if transport is not None else 0
        if self.error is None and not self._buffer.push(data, held):
            self._cut(BUFFER_FULL)
        if self.error is not None:
            raise self.error
        self._idle.clear()
        self._wake.set()

    async def finish(self, data: bytes = b"") -> None:
        """Send ``data``, wait (at most the write timeout) until everything reached the
        response, and end it; ClientGoneError when the client is cut off meanwhile."""
        if data:
            self.send(data)
        try:
            async with asyncio.timeout(self._write_timeout_s):
                await self._idle.wait()
                if self.error is None:
                    await self._response.write_eof()
        except TimeoutError:
            self._cut(WRITE_TIMEOUT)
        except ConnectionError:
            self.error = self.error or ClientGoneError("client disconnected")
        if self.error is not None:
            raise self.error

    def drop_connection(self) -> None:
        """Close the client's connection at once (unsent bytes are dropped)."""
        transport = self._http.transport
        if transport is not None:
            transport.abort()

    def _cut(self, reason: str) -> None:
        if self.error is None:
            log.info("client cut off", reason=reason, buffered_bytes=self._buffer.num_bytes)
            self.error = ClientGoneError(f"client too slow ({reason})", cutoff=reason)
        self._idle.set()

    async def _write_loop(self) -> None:
        while self.error is None:
            await self._wake.wait()
            self._wake.clear()
            while self.error is None and (data := self._buffer.take()):
                try:
                    async with asyncio.timeout(self._write_timeout_s):
                        await self._response.write(data)
                except TimeoutError:
                    self._cut(WRITE_TIMEOUT)
                except ConnectionError:  # reset, or aiohttp's "cannot write to closing transport"
                    self.error = ClientGoneError("client disconnected")
            self._idle.set()
