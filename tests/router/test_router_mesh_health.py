"""What the router's /health and its requests say about a mesh missing a part (issue 43, items 5
and 6), on a real nats-server with the fake mesh: a mesh without its prefill queue fails a
request that needs a prefill within seconds, with a 503 that names the queue, and /health says
so; a kv-store heard once and silent now makes /health "degraded" (200: the mesh serves)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.queue_health import GRACE_S
from kvmesh.services.router.service import serve_router
from support.router_fake_mesh import FakeMesh

MODEL = "kvmesh-tiny"
LONG_PROMPT = "x" * 80  # over the default local_prefill_threshold (64 tokens): remote prefill


@contextlib.asynccontextmanager
async def mesh_and_router(mesh: FakeMesh, **config):
    config = RouterConfig(nats_url=mesh.nats_url, host="127.0.0.1", port=0, **config)
    async with (
        mesh.running(),
        serve_router(config) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield running, http


async def _health(http: aiohttp.ClientSession) -> tuple[int, dict]:
    async with http.get("/health") as resp:
        return resp.status, await resp.json()


async def test_request_needing_prefill_fails_fast_when_prefill_queue_missing(nats_server):
    mesh = FakeMesh(nats_server, make_queue=False)
    async with mesh_and_router(mesh, worker_liveness_s=0.5) as (_, http):
        await asyncio.sleep(0.7)  # the router heard the workers
        assert (await _health(http))[0] == 200
        started = time.monotonic()
        async with http.post(
            "/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}
        ) as resp:
            status, body = resp.status, await resp.json()
        took = time.monotonic() - started
        health_status, health = await _health(http)
        # a short prompt (prefilled on the decode worker) is still served
        async with http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
        ) as resp:
            assert resp.status == 200, await resp.text()
    assert status == 503, body
    assert took < GRACE_S + 3, f"the request waited {took:.1f} s"
    message = body["error"]["message"]
    assert "prefill queue KVMESH_PREFILL_" in message and "is missing" in message, message
    assert "kvmesh serve prefill-queue" in message, message
    assert health_status == 503 and "prefill queue" in health["reason"], health


async def test_health_is_ok_again_once_the_missing_prefill_queue_is_made(nats_server):
    from kvmesh.services.prefill_queue.keeper import ensure_queue
    from kvmesh.shared.bus.nats_connect import connect_nats

    mesh = FakeMesh(nats_server, make_queue=False)
    async with mesh_and_router(mesh, worker_liveness_s=0.5) as (_, http):
        payload = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}
        async with http.post("/v1/completions", json=payload) as resp:
            assert resp.status == 503
        assert (await _health(http))[0] == 503
        async with connect_nats(nats_server, "admin") as nc:
            await ensure_queue(nc, mesh.subjects)
        # streamed: its 200 comes once the job is in the queue (no worker of this fake mesh
        # takes it: the stream is left there)
        async with (
            asyncio.timeout(10),
            http.post("/v1/completions", json=payload | {"stream": True}) as resp,
        ):
            assert resp.status == 200, await resp.text()
        assert (await _health(http))[0] == 200


async def test_health_says_degraded_when_a_kv_store_goes_silent(nats_server):
    mesh = FakeMesh(nats_server, optional_alive={"kv-store", "draft"})
    async with mesh_and_router(mesh, worker_liveness_s=0.5) as (_, http):
        await asyncio.sleep(0.7)
        assert await _health(http) == (200, {**(await _health(http))[1], "status": "ok"})
        mesh.optional_alive.discard("kv-store")  # it died; the supervisor left it down
        await asyncio.sleep(1.0)
        status, body = await _health(http)
        async with http.post(
            "/v1/completions", json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4}
        ) as resp:
            assert resp.status == 200, await resp.text()  # it serves without it
    assert status == 200
    assert body["status"] == "degraded"
    assert body["reason"] == "degraded: kv-store (kv-store-fake silent)", body
