"""The router's HTTP limits against a real router on a real nats-server (issue 27, item 7): 100
slowloris connections (a header byte every 0.2 s) no longer stay open (before: 30 s and more),
one client cannot hold more than its cap, a body that trickles gets a 408, and another client
is served meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import pytest
from kvmesh.services.router.config import HttpLimits, RouterConfig
from support.router_fake_mesh import FakeMesh, router_over

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, CAP = 1.0, 1.0, 16
NUM_SLOW = 100


async def _slowloris(port: int, stop: asyncio.Event) -> float | None:
    """One connection that sends a request's headers a byte at a time; when the router closed
    it (seconds after it opened), or None if it was still open when told to stop."""
    opened = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return 0.0
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nX-Slow: ")
        while not stop.is_set():
            await writer.drain()
            try:
                if await asyncio.wait_for(reader.read(1024), 0.2) == b"":
                    return time.monotonic() - opened  # closed by the router
            except TimeoutError:
                writer.write(b"a")
        return None
    except (ConnectionError, OSError):
        return time.monotonic() - opened
    finally:
        writer.close()


@pytest.fixture
async def router(nats_server):
    async with router_over(
        FakeMesh(nats_server),
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        max_connections_per_client=CAP,
    ) as running:
        yield running


async def test_slowloris_connections_are_closed_and_others_are_served(router):
    stop = asyncio.Event()
    slow = [asyncio.create_task(_slowloris(router.port, stop)) for _ in range(NUM_SLOW)]
    await asyncio.sleep(0.3)  # all of them connected, none has sent its headers
    # another client (another loopback address) is served while they hang on
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"{router.url}/health") as resp,
    ):
        assert resp.status in (200, 503)  # answered (ready or not), not held
    await asyncio.sleep(HEADER_TIMEOUT_S + 2.0)
    stop.set()
    closed = await asyncio.gather(*slow)
    assert None not in closed, f"{closed.count(None)} slow connections still open"
    assert sum(t < 0.3 for t in closed) >= NUM_SLOW - CAP  # over the cap: closed at once
    assert max(closed) < HEADER_TIMEOUT_S + 1.5  # the others when their header time ran out
    metrics = router.router.metrics
    refused = {
        reason: metrics.registry.get_sample_value(
            "kvmesh_router_http_refused_total", {"reason": reason}
        )
        for reason in ("too_many_connections", "header_timeout")
    }
    assert refused["too_many_connections"] >= NUM_SLOW - CAP and refused["header_timeout"] >= 1


async def test_a_trickling_body_gets_a_408(router):
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    await writer.drain()
    started = time.monotonic()
    answer = await asyncio.wait_for(reader.readline(), BODY_TIMEOUT_S + 5)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert time.monotonic() - started >= BODY_TIMEOUT_S * 0.9


async def test_a_kept_alive_connection_serves_request_after_request(router):
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.get(f"{router.url}/v1/models") as resp:
                assert resp.status == 200
            await asyncio.sleep(HEADER_TIMEOUT_S * 0.6)  # within the header time each


def test_limits_must_be_positive():
    limits = RouterConfig().http_limits()
    assert limits == HttpLimits(10.0, 30.0, 64, 2048)  # the router's defaults
    with pytest.raises(ValueError, match="header_timeout_s"):
        dataclasses.replace(limits, header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections_per_client"):
        dataclasses.replace(limits, max_connections_per_client=0)
    with pytest.raises(ValueError, match="body_timeout_s"):
        RouterConfig(body_timeout_s=0)
