"""A healthy stream on a kept-alive connection is not cut by the header timer (issue 43, item 1).

Before, the done middleware re-armed the header timer when a request ended even though the next
request's headers were already read (pipelined, or sent by a client that read the end of the
response before the handler returned): the timer then aborted that request mid-stream. Here the
header timeout is 0.5 s and each stream lasts about 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.http_limits import ConnectionTable, GuardedSite, request_done_middleware
from support.router_fake_mesh import FakeMesh, router_over

HEADER_TIMEOUT_S = 0.5
NUM_STREAM_TOKENS, TOKEN_DELAY_S = 80, 0.025  # a stream of about 2 s, 4x the header timeout


@pytest.fixture
async def router(nats_server):
    mesh = FakeMesh(nats_server, eos_at_end=False, token_delay_s=TOKEN_DELAY_S)
    async with router_over(
        mesh, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=HEADER_TIMEOUT_S
    ) as running:
        yield running


def _stream_body() -> bytes:
    return json.dumps(
        {"model": "kvmesh-tiny", "prompt": "hi", "max_tokens": NUM_STREAM_TOKENS, "stream": True}
    ).encode()


def _num_tokens(sse: str) -> int:
    """The text characters (one per token: byte-level reply) of an SSE completion stream."""
    chunks = [line[6:] for line in sse.splitlines() if line.startswith("data: {")]
    return sum(len(json.loads(c)["choices"][0]["text"]) for c in chunks)


async def test_pipelined_stream_completes_beyond_header_timeout(router):
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    body = _stream_body()
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: router\r\n\r\n"
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body
    )
    await writer.drain()
    received = await asyncio.wait_for(reader.read(), NUM_STREAM_TOKENS * TOKEN_DELAY_S + 10)
    writer.close()
    text = received.decode()
    assert text.count("HTTP/1.1 200") == 2, text[:400]
    assert "data: [DONE]" in text, f"stream cut after {_num_tokens(text)} tokens"
    assert _num_tokens(text) == NUM_STREAM_TOKENS
    refused = router.router.metrics.registry.get_sample_value(
        "kvmesh_router_http_refused_total", {"reason": "header_timeout"}
    )
    assert not refused


async def _stream_then_linger(request: web.Request) -> web.StreamResponse:
    """A stream that outlasts the header timeout, then work after its end (as the router's
    handler aborts the mesh request and unsubscribes after ``write_eof``): a client has read the
    end and sent its next request before the handler returns."""
    response = web.StreamResponse()
    await response.prepare(request)
    for _ in range(NUM_STREAM_TOKENS):
        await response.write(b"t")
        await asyncio.sleep(TOKEN_DELAY_S)
    await response.write_eof()
    await asyncio.sleep(0.2)
    return response


@contextlib.asynccontextmanager
async def _guarded_app() -> AsyncIterator[tuple[str, list[str]]]:
    refused: list[str] = []
    limits = RouterConfig(header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=HEADER_TIMEOUT_S)
    table = ConnectionTable(limits.http_limits(), refused.append)
    app = web.Application(middlewares=[request_done_middleware(table)])
    app.add_routes([web.get("/stream", _stream_then_linger)])
    runner = web.AppRunner(app)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, table)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", refused
    finally:
        await runner.cleanup()


async def _client(url: str, num_streams: int) -> list[bytes]:
    """Streams one after another on one kept-alive connection."""
    got = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
        for _ in range(num_streams):
            try:
                async with session.get(f"{url}/stream") as resp:
                    got.append(await resp.read())
            except aiohttp.ClientError as exc:
                got.append(repr(exc).encode())
    return got


async def test_keepalive_clients_streams_not_cut_by_header_timeout():
    num_clients, num_streams = 8, 3
    async with _guarded_app() as (url, refused):
        results = await asyncio.wait_for(
            asyncio.gather(*(_client(url, num_streams) for _ in range(num_clients))),
            num_streams * NUM_STREAM_TOKENS * TOKEN_DELAY_S + 30,
        )
    streams = [body for client in results for body in client]
    cut = [body[:60] for body in streams if body != b"t" * NUM_STREAM_TOKENS]
    assert not cut, f"{len(cut)} of {len(streams)} streams cut: {cut}"
    assert refused == []
