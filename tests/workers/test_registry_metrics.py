"""The kv-registry's /metrics endpoint against a real nats-server and a protocol peer: a refusal
and a placement move the counters they should."""

from __future__ import annotations

import aiohttp
from kvmesh.loadgen import prom_text
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import PlaceReply, PlaceRequest
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.text.sampling import SamplingOptions
from support.registry_peers import peer_decode, wait_for

subjects = Subjects(DEFAULT_MESH)


async def _place(nc, request_id: str) -> PlaceReply:
    request = PlaceRequest(
        request_id=request_id,
        prompt_ids=tuple(range(40)),
        sampling=SamplingOptions(max_tokens=4),
        local_prefill=False,
        lease_ms=5_000,
    )
    msg = await nc.request(subjects.REGISTRY_PLACE, encode_message(request), timeout=3)
    return decode_message(msg.data, PlaceReply)


async def _scrape(port: int) -> str:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as resp,
    ):
        assert resp.status == 200
        return await resp.text()


async def test_registry_metrics_count_refusals_placements_and_leases(nats_server: str) -> None:
    config = RegistryConfig(nats_url=nats_server, heartbeat_s=0.1, metrics_port=0)
    async with (
        registry_service(config) as registry,
        connect_nats(nats_server, "client") as nc,
    ):
        assert registry.metrics_port
        refused = await _place(nc, "r0")  # no decode worker yet
        async with peer_decode(nats_server, "d1"):
            await wait_for(lambda: "d1" in registry.core.decode)
            placed = await _place(nc, "r1")
            text = await _scrape(registry.metrics_port)
    assert not refused.ok and placed.ok, placed.error
    assert 'kvmesh_registry_refusals_total{reason="no_workers"} 1.0' in text
    assert 'kvmesh_registry_placements_total{prefill="remote"} 1.0' in text
    assert 'kvmesh_registry_leases_total{outcome="granted"} 1.0' in text
    assert 'kvmesh_registry_workers{role="decode"} 1.0' in text
    assert prom_text.totals(text)["kvmesh_registry_place_seconds_count"] == 2


async def test_registry_without_a_metrics_port_serves_none(nats_server: str) -> None:
    async with registry_service(RegistryConfig(nats_url=nats_server)) as registry:
        assert registry.metrics_port is None
