"""Prefix-aware placement end to end: real nats-server, kv-registry, router, one prefill and two
decode workers (kvmesh-tiny, shm).

The first request is prefilled remotely on decode-1 (decode-0 drained meanwhile, so that the
default tie-break, the lower id, would pick the wrong worker for the second). Once the registry's
index shows decode-1 holding its blocks, a second request sharing its 128-token prefix goes to
decode-1 although decode-0 is idle again, is prefilled there (no prefill job: no PrefillDone), and
decode-1's engine takes the 128 cached tokens instead of computing them; both outputs equal the
offline engine's, token for token.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from kvmesh.shared.bus.admin_client import admin_client
from support.mesh_checks import poll_status, scrape

from kvmesh.testing.mesh import MeshTap, complete, local_mesh, random_prompts
from kvmesh.testing.offline import offline_greedy_each

pytestmark = pytest.mark.slow

ENV = {"KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "256", "KVMESH_CHUNK_TOKENS": "64"}
PREFIX = random_prompts(1, 128, 128, seed=11)[0]  # 8 blocks
FIRST = [*PREFIX, 3, 1, 4, 1, 5, 9, 2, 6]  # 136 tokens: 8 full blocks cached after its prefill
SECOND = [*PREFIX, 2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]  # 140: 8 reusable blocks, 12 to compute
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def offline_tokens() -> list[list[int]]:
    greedy = offline_greedy_each(MAX_TOKENS)
    return [greedy(p) for p in (FIRST, SECOND)]


async def wait_status(admin, ready, what: str) -> dict:
    """Admin status once ``ready(decode rows by id)`` holds (a barrier, polled); those rows."""
    status = await poll_status(admin, lambda s: ready(_decode_rows(s)), what, timeout_s=20.0)
    return _decode_rows(status)


def _decode_rows(status) -> dict:
    return {r.worker_id: r for r in status.decode}


async def run(mesh, offline: list[list[int]]) -> None:
    async with (
        admin_client(mesh.config.nats_url, auth=mesh.nats_auth) as admin,
        MeshTap(mesh.config.nats_url, mesh.nats_auth) as tap,
        aiohttp.ClientSession() as session,
    ):
        await wait_status(
            admin,
            lambda rows: len(rows) == 2 and all(r.cache_synced for r in rows.values()),
            "both decode workers and their first digests",
        )
        await admin.drain("decode-0")
        first = await complete(session, mesh.url, FIRST, MAX_TOKENS)
        await admin.resume("decode-0")
        await tap.wait_finished(first["id"])
        rows = await wait_status(
            admin,
            lambda rows: (
                rows["decode-1"].cached_blocks >= 8 and rows["decode-0"].load.state == "ready"
            ),
            "decode-1's cached prefix in the registry's index",
        )
        assert rows["decode-0"].cached_blocks == 0
        second = await complete(session, mesh.url, SECOND, MAX_TOKENS)
        await tap.wait_finished(second["id"])
        assert first["id"] in tap.prefill_done  # the first was prefilled remotely...
        assert second["id"] not in tap.prefill_done  # ...the second by its decode worker
        assert [tap.tokens[first["id"]], tap.tokens[second["id"]]] == offline
    decode0 = scrape(mesh.metrics_urls["decode-0"])
    decode1 = scrape(mesh.metrics_urls["decode-1"])
    registry = scrape(mesh.metrics_urls["kv-registry-0"])
    assert decode1["kvmesh_decode_prefix_cache_hit_tokens_total"] == 128
    assert decode0.get("kvmesh_decode_generated_tokens_total", 0) == 0
    assert registry["kvmesh_registry_prefix_hit_placements_total"] == 1
    assert registry["kvmesh_registry_prefix_matched_tokens_total"] == 128


@pytest.mark.timeout(300)
def test_shared_prefix_request_lands_on_its_holder_and_computes_only_the_suffix(
    offline_tokens: list[list[int]],
) -> None:
    with local_mesh("disagg", "shm", env=ENV, decode=2, local_prefill_threshold=0) as mesh:
        asyncio.run(run(mesh, offline_tokens))
