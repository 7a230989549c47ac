"""ClientStream: a stream's bytes go to its client through a bounded send buffer and a write
timeout; a client that does not read is cut off without holding up anything else (a real aiohttp
server and real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from kvmesh.services.router.client_stream import (
    BUFFER_FULL,
    WRITE_TIMEOUT,
    ClientStream,
    SendBuffer,
)
from kvmesh.services.router.errors import ClientGoneError

CHUNK = b"data: " + b"x" * 200 + b"\n\n"


def test_send_buffer_takes_chunks_up_to_its_limit_and_hands_them_out_as_one():
    buffer = SendBuffer(max_bytes=10)
    assert buffer.push(b"abcd") and buffer.push(b"efgh")
    assert not buffer.push(b"ijk")  # 11 bytes: refused, nothing queued
    assert buffer.num_bytes == 8
    assert buffer.take() == b"abcdefgh" and buffer.num_bytes == 0
    assert buffer.take() == b""
    assert not buffer.push(b"abcd", num_sent_unread=7)  # 7 bytes still in the transport


@contextlib.asynccontextmanager
async def _server(num_chunks: int, max_buffer_bytes: int, write_timeout_s: float, outcomes: list):
    """A server streaming ``num_chunks`` chunks as fast as it can through a ClientStream; each
    handler's outcome ("done" or the ClientGoneError) lands in ``outcomes``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        stream = ClientStream(
            request,
            response,
            max_buffer_bytes=max_buffer_bytes,
            write_timeout_s=write_timeout_s,
        )
        try:
            async with stream:
                for _ in range(num_chunks):
                    stream.send(CHUNK)
                    await asyncio.sleep(0.001)  # a token every millisecond
                await stream.finish(b"data: [DONE]\n\n")
            outcomes.append("done")
        except ClientGoneError as exc:
            outcomes.append(exc)
        return response

    app = web.Application()
    app.router.add_get("/", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def test_a_reading_client_gets_every_byte_and_the_end():
    outcomes: list = []
    async with (
        _server(500, 64 * 1024, 2.0, outcomes) as port,
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/") as resp,
    ):
        body = await resp.read()
    assert body == CHUNK * 500 + b"data: [DONE]\n\n"
    assert outcomes == ["done"]


async def _ticks_while(seconds: float) -> float:
    """The longest gap of a 10 ms ticker on this event loop over ``seconds``."""
    worst, last, end = 0.0, time.monotonic(), time.monotonic() + seconds
    while time.monotonic() < end:
        await asyncio.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    return worst


def _silent_client(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    return sock


@pytest.mark.parametrize(
    ("max_buffer_bytes", "write_timeout_s", "cutoff"),
    [(16 * 1024, 30.0, BUFFER_FULL), (8 * 1024 * 1024, 0.5, WRITE_TIMEOUT)],
)
@pytest.mark.slow  # seconds: left out of make test-fast
async def test_a_client_that_reads_nothing_is_cut_off_and_holds_up_nothing(
    max_buffer_bytes, write_timeout_s, cutoff
):
    outcomes: list = []
    # 20 MB in all: more than any socket buffer takes
    async with _server(100_000, max_buffer_bytes, write_timeout_s, outcomes) as port:
        sock = await asyncio.to_thread(_silent_client, port)
        try:
            started = time.monotonic()
            worst_gap = 0.0
            while not outcomes:
                worst_gap = max(worst_gap, await _ticks_while(0.1))
                assert time.monotonic() - started < 20, "never cut off"
        finally:
            sock.close()
    [error] = outcomes
    assert isinstance(error, ClientGoneError) and error.cutoff == cutoff
    assert error.reason == "client too slow"
    assert worst_gap < 0.25  # the event loop kept running
