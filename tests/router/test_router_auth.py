"""The router's API key (OpenAI ``Authorization: Bearer``) and its body-size limit, over HTTP on
the real middlewares: 401 and 413 in OpenAI's JSON error shape, open health and metrics."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.http_server import api_key_middleware, error_middleware


def _app(api_key: str | None, max_body_bytes: int = 1 << 20) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"ok": True})

    app = web.Application(
        middlewares=[error_middleware, api_key_middleware(api_key)],
        client_max_size=max_body_bytes,
    )
    app.add_routes([web.post("/v1/completions", ok), web.get("/v1/models", ok)])
    app.add_routes([web.get("/health", ok), web.get("/metrics", ok)])
    return app


async def test_api_key_required_on_v1_routes_and_not_on_health() -> None:
    async with TestClient(TestServer(_app("s3cret"))) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            resp = await client.get("/v1/models", headers=headers)
            body = await resp.json()
            assert resp.status == 401 and body["error"]["code"] == "invalid_api_key"
            assert resp.headers["WWW-Authenticate"] == "Bearer"
        resp = await client.post(
            "/v1/completions", json={}, headers={"Authorization": "Bearer s3cret"}
        )
        assert resp.status == 200
        for path in ("/health", "/metrics"):
            assert (await client.get(path)).status == 200


async def test_no_api_key_leaves_the_routes_open() -> None:
    async with TestClient(TestServer(_app(None))) as client:
        assert (await client.get("/v1/models")).status == 200


async def test_body_over_the_limit_is_a_json_413() -> None:
    async with TestClient(TestServer(_app(None, max_body_bytes=1024))) as client:
        resp = await client.post("/v1/completions", data=b"x" * 4096)
        body = await resp.json()
        assert resp.status == 413 and body["error"]["code"] == "request_too_large"
        assert "--max-body-mb" in body["error"]["message"]


def test_api_key_and_body_limit_config_errors_say_what_to_fix() -> None:
    with pytest.raises(ValueError, match="api_key must not be empty"):
        RouterConfig(api_key=" ")
    with pytest.raises(ValueError, match="max_body_mb must be positive"):
        RouterConfig(max_body_mb=0)


def test_api_key_never_shows_in_the_config_repr_that_services_log() -> None:
    config = RouterConfig(api_key="s3cret-key", api_keys="k2,k3", admin_api_key="adm1n")
    shown = repr(config)
    assert not any(secret in shown for secret in ("s3cret-key", "k2", "adm1n"))
    assert ", api_key=" not in shown and "api_keys=" not in shown
