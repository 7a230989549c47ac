"""Several routers on one port (``kvmesh up --routers N``): each a process of its own with its
own worker id, all bound with SO_REUSEPORT, so that when one dies the kernel gives new
connections to the live ones (docs/faults.md, several routers on one port)."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from aiohttp import web
from kvmesh.services.router.http_limits import ConnectionTable, HttpLimits
from kvmesh.services.router.http_server import serve_http
from kvmesh.shared.config.ports import free_port

from kvmesh.commands.serve import build_service_config
from kvmesh.commands.up_config import UpConfig
from kvmesh.commands.up_plan import plan


def test_up_starts_each_router_on_the_one_port_with_reuse_port() -> None:
    specs = [s for s in plan(UpConfig(routers=3), "nats://x:1", 8123) if s.tier == "router"]
    assert [s.name for s in specs] == ["router-0", "router-1", "router-2"]
    for spec in specs:
        _, router, _ = build_service_config("router", spec.argv[2:], env={})
        assert (router.worker_id, router.port, router.reuse_port) == (spec.name, 8123, True)
    (one,) = [s for s in plan(UpConfig(), "nats://x:1", 8123) if s.tier == "router"]
    assert "--reuse-port" not in one.argv  # one router binds its port alone, as before
    with pytest.raises(ValueError, match="routers"):
        UpConfig(routers=0)


def _app(name: str) -> web.Application:
    async def who(request: web.Request) -> web.Response:
        return web.Response(text=name)

    app = web.Application()
    app.add_routes([web.get("/who", who)])
    return app


async def test_routers_share_a_port_and_the_live_one_takes_new_connections() -> None:
    port = free_port()
    table = lambda: ConnectionTable(HttpLimits(10.0, 30.0, 64, 64), lambda _: None)
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(
            serve_http(_app("a"), "127.0.0.1", port, table(), reuse_port=True)
        )
        b = contextlib.AsyncExitStack()
        await b.enter_async_context(
            serve_http(_app("b"), "127.0.0.1", port, table(), reuse_port=True)
        )
        answers = set()
        for _ in range(40):  # the kernel spreads new connections over both
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/who") as r,
            ):
                answers.add(await r.text())
        assert answers == {"a", "b"}
        await b.aclose()  # router b is gone: nothing new is refused
        for _ in range(10):
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://127.0.0.1:{port}/who") as r,
            ):
                assert await r.text() == "a"
