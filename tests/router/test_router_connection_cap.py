"""The router's global cap on HTTP connections, its accept-failure log and the open-file limit
(issue 40, #6): 1,100 idle keep-alive connections from 20 loopback addresses ran the router out
of descriptors, a victim request timed out, and every failed accept logged a traceback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from types import SimpleNamespace

import aiohttp
import pytest
from kvmesh.services.router.config import FD_RESERVE, HttpLimits, RouterConfig
from kvmesh.services.router.http_limits import (
    ACCEPT_OUT_OF_RESOURCES,
    AcceptErrorLog,
    ConnectionTable,
)
from kvmesh.services.router.service import serve_router
from support.router_fake_mesh import FakeMesh

NUM_IDLE, CAP = 12, 8


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def _table(max_connections: int) -> tuple[ConnectionTable, list[str]]:
    refused: list[str] = []
    return ConnectionTable(HttpLimits(10.0, 30.0, 64, max_connections), refused.append), refused


def _open(table: ConnectionTable, client: str, *, waiting_headers: bool) -> _Transport:
    assert table.admit(client)
    transport = _Transport()
    table.guards[transport] = SimpleNamespace(waiting_headers=waiting_headers)  # type: ignore[index]
    return transport


def test_admit_over_the_global_cap_pushes_out_the_oldest_idle_connection():
    table, refused = _table(3)
    busy = _open(table, "10.0.0.1", waiting_headers=False)
    idle_old = _open(table, "10.0.0.2", waiting_headers=True)
    idle_new = _open(table, "10.0.0.3", waiting_headers=True)
    assert table.admit("10.0.0.4")
    assert idle_old.aborted and not idle_new.aborted and not busy.aborted
    assert idle_old not in table.guards and table.num_open == 2  # room counts at once
    assert refused == ["pushed_out"]


def test_admit_over_the_global_cap_refuses_when_every_connection_is_in_a_request():
    table, refused = _table(2)
    first = _open(table, "10.0.0.1", waiting_headers=False)
    second = _open(table, "10.0.0.2", waiting_headers=False)
    assert not table.admit("10.0.0.3")
    assert not first.aborted and not second.aborted
    assert refused == ["router_full"] and "10.0.0.3" not in table.per_client


def test_max_connections_is_lowered_to_the_open_file_limit_when_over_it():
    limits = RouterConfig().http_limits()
    assert limits.max_connections == 2048
    assert limits.within_open_files(1024).max_connections == 1024 - FD_RESERVE
    assert limits.within_open_files(1 << 20).max_connections == 2048
    with pytest.raises(ValueError, match="max_connections"):
        RouterConfig(max_connections=0)


def test_accept_failures_are_logged_once_a_second_with_their_count(monkeypatch):
    from kvmesh.services.router import http_limits

    lines: list[dict] = []
    monkeypatch.setattr(
        http_limits.log, "warning", lambda event, **fields: lines.append(fields), raising=False
    )
    now = [100.0]
    refused: list[str] = []
    accept_log = AcceptErrorLog(refused.append, interval_s=1.0, clock=lambda: now[0])
    others: list[dict] = []
    accept_log.previous = lambda loop, context: others.append(context)
    emfile = {"message": ACCEPT_OUT_OF_RESOURCES, "exception": OSError(24, "Too many open files")}
    loop = asyncio.new_event_loop()
    try:
        for _ in range(500):  # a flood of failed accepts within one second
            accept_log(loop, emfile)
            now[0] += 0.001
        now[0] += 1.0
        accept_log(loop, emfile)
        accept_log(loop, {"message": "something else"})
    finally:
        loop.close()
    assert [line["failed_accepts"] for line in lines] == [1, 500]
    assert refused.count("accept_failed") == 501
    assert others == [{"message": "something else"}]  # not swallowed


async def test_a_request_is_served_while_idle_connections_fill_the_global_cap(nats_server):
    config = RouterConfig(
        nats_url=nats_server, host="127.0.0.1", port=0, max_connections=CAP, header_timeout_s=30
    )
    async with FakeMesh(nats_server).running(), serve_router(config) as router:
        idle = []
        for i in range(NUM_IDLE):  # idle keep-alive connections from several addresses
            source = (f"127.0.0.{2 + i % 4}", 0)
            idle.append(await asyncio.open_connection("127.0.0.1", router.port, local_addr=source))
        await asyncio.sleep(0.2)
        assert router.router.connections.num_open <= CAP
        assert isinstance(asyncio.get_running_loop().get_exception_handler(), AcceptErrorLog)
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{router.url}/v1/models", timeout=5) as resp,
        ):
            assert resp.status == 200
        pushed = router.router.metrics.registry.get_sample_value(
            "kvmesh_router_http_refused_total", {"reason": "pushed_out"}
        )
        for _, writer in idle:
            writer.close()
    assert pushed is not None and pushed >= NUM_IDLE - CAP + 1


def test_serving_raises_the_open_file_limit_to_the_hard_limit():
    script = (
        "import resource\n"
        "from kvmesh.shared.config.open_files import raise_open_file_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "print(raise_open_file_limit() == (min(hard, 1 << 20), hard))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True", out.stderr


async def _raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and the first ``body`` bytes, not all the Content-Length says); the
    router's status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


async def test_an_oversize_body_is_refused_from_its_content_length_on_every_route(nats_server):
    """The defect: a 60 MB body was read whole (under the old 64 MiB limit, and any larger one
    up to the limit) before a 413; 4 of them stalled the router's loop 2.9 s."""
    config = RouterConfig(nats_url=nats_server, host="127.0.0.1", port=0, max_body_mb=1.0)
    async with FakeMesh(nats_server).running(), serve_router(config) as router:
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
            ("GET", "/v1/models"),
        ):
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                f"Content-Length: 60000000\r\n\r\n"
            ).encode()
            status = await _raw_request(router.port, head, b'{"model": "kvmesh-tiny"')
            assert status.startswith(b"HTTP/1.1 413"), (path, status)
        refused = router.router.metrics.registry.get_sample_value(
            "kvmesh_router_http_refused_total", {"reason": "body_too_large"}
        )
    assert refused == 4
    assert RouterConfig().max_body_mb == 8.0


async def test_a_chunked_body_is_refused_at_the_limit_before_its_end(nats_server):
    config = RouterConfig(nats_url=nats_server, host="127.0.0.1", port=0, max_body_mb=0.01)
    async with FakeMesh(nats_server).running(), serve_router(config) as router:
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 4096
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(4))  # no end
        status = await _raw_request(router.port, head, chunks)
    assert status.startswith(b"HTTP/1.1 413"), status
