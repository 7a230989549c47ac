"""The NATS server restarts under a running mesh (real processes): every service reconnects, the
prefill queue is made again in the new server, and the mesh serves again within seconds."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from loadgen.bench_mesh import complete, local_mesh, random_prompts
from shared.commands.up import free_port
from shared.nats_server import NatsServer

pytestmark = pytest.mark.slow

ENV = {"KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "512"}


async def _serve_until_ok(url: str, prompt: list[int], timeout_s: float) -> tuple[dict, float]:
    """Send the request until the mesh answers it (503/504 while it reconnects)."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                return await complete(session, url, prompt, 4), time.monotonic() - started
            except (AssertionError, aiohttp.ClientError):
                assert time.monotonic() - started < timeout_s, "the mesh did not serve again"
                await asyncio.sleep(0.5)


def test_mesh_serves_again_after_the_nats_server_restarts():
    port = free_port()
    server = NatsServer(port)
    server.start()
    try:
        with local_mesh("disagg", "tcp", nats_url=server.url, env=ENV) as mesh:
            [long_prompt] = random_prompts(1, 300, 300, seed=41)  # remote prefill: the queue
            body, _ = asyncio.run(_serve_until_ok(mesh.url, long_prompt, 30))
            assert body["usage"]["completion_tokens"] == 4
            server.stop()  # its JetStream store goes with it
            server = NatsServer(port)
            server.start()
            body, waited = asyncio.run(_serve_until_ok(mesh.url, long_prompt, 60))
            assert body["usage"]["completion_tokens"] == 4
            assert waited < 30
            for prompt in random_prompts(3, 200, 400, seed=42):  # and keeps serving
                body, _ = asyncio.run(_serve_until_ok(mesh.url, prompt, 5))
                assert body["usage"]["completion_tokens"] == 4
    finally:
        server.stop()
