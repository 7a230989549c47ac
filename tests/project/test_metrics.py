"""The metrics exporter over real HTTP, and what each service's metrics module counts."""

from __future__ import annotations

import aiohttp
import pytest
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.kv_registry.core import LeaseCounters, RegistryState
from kvmesh.services.kv_registry.metrics import RegistryMetrics
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import PrefillTiming
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.obs.metrics_exporter import serve_metrics
from prometheus_client import CollectorRegistry, Counter


async def test_serve_metrics_answers_a_scrape_on_a_free_port() -> None:
    registry = CollectorRegistry()
    Counter("kvmesh_test_things_total", "Things.", registry=registry).inc(3)
    async with (
        serve_metrics(registry, "127.0.0.1", 0) as port,
        aiohttp.ClientSession() as http,
    ):
        assert port
        async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
            content_type = resp.headers["Content-Type"]
        accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
        async with http.get(f"http://127.0.0.1:{port}/metrics", headers=accept) as resp:
            openmetrics = await resp.text()
    assert content_type.startswith("text/plain")
    assert "kvmesh_test_things_total 3.0" in text
    assert openmetrics.rstrip().endswith("# EOF")  # what Prometheus asks for


async def test_serve_metrics_without_a_port_serves_nothing() -> None:
    async with serve_metrics(CollectorRegistry(), "127.0.0.1", None) as port:
        assert port is None


async def test_serve_metrics_on_a_taken_port_says_which_flag_to_change() -> None:
    async with serve_metrics(CollectorRegistry(), "127.0.0.1", 0) as port:
        with pytest.raises(ServiceStartError, match="--metrics-port"):
            async with serve_metrics(CollectorRegistry(), "127.0.0.1", port):
                pass


def test_decode_metrics_count_steps_tokens_and_new_preemptions_only() -> None:
    from kvmesh.shared.bus.messages.workers import BlockPool, WorkerLoad

    m = DecodeMetrics()
    m.observe_step(0.02, batch_size=3, num_tokens=3, num_preemptions=0)
    m.observe_step(0.04, batch_size=0, num_tokens=0, num_preemptions=2)
    m.observe_step(0.01, batch_size=2, num_tokens=2, num_preemptions=2)  # no new preemption
    m.observe_load(WorkerLoad("ready", num_running=2, num_waiting=5), BlockPool(64, 40, ((0, 40),)))
    value = m.registry.get_sample_value
    assert value("kvmesh_decode_step_seconds_count") == 3
    assert value("kvmesh_decode_batch_size_count") == 2  # idle steps are no batch
    assert value("kvmesh_decode_batch_size_sum") == 5
    assert value("kvmesh_decode_generated_tokens_total") == 5
    assert value("kvmesh_decode_preemptions_total") == 2
    assert value("kvmesh_decode_requests_running") == 2
    assert value("kvmesh_decode_requests_waiting") == 5
    assert value("kvmesh_decode_kv_blocks_used") == 24


def test_prefill_metrics_count_bytes_bandwidth_and_job_outcomes() -> None:
    m = PrefillMetrics()
    m.observe_chunk(0.5)
    m.observe_write(4096, 0.002)
    m.observe_write(1024, 0.0)  # a write that took no measurable time has no bandwidth
    m.observe_job(PrefillTiming(0.3, 0.5, 0.002, 0.001, 1), ok=True)
    m.observe_job(None, ok=False)  # refused before it computed
    value = m.registry.get_sample_value
    assert value("kvmesh_prefill_kv_bytes_written_total") == 5120
    assert value("kvmesh_prefill_kv_write_seconds_count") == 2
    assert value("kvmesh_prefill_kv_write_bandwidth_bytes_per_second_sum") == 4096 / 0.002
    assert value("kvmesh_prefill_chunk_compute_seconds_sum") == 0.5
    assert value("kvmesh_prefill_queue_wait_seconds_sum") == 0.3
    assert value("kvmesh_prefill_kv_exposed_transfer_seconds_sum") == 0.001
    assert value("kvmesh_prefill_jobs_total", {"outcome": "ok"}) == 1
    assert value("kvmesh_prefill_jobs_total", {"outcome": "failed"}) == 1


def test_registry_metrics_read_leases_from_the_core_at_scrape_time() -> None:
    core = RegistryState(worker_timeout_s=3.0)
    m = RegistryMetrics(core)
    core.counters = LeaseCounters(granted=4, completed=2, expired=1, dropped=1)
    m.observe_place(0.01, local_prefill=False)
    m.observe_place(0.02, local_prefill=True, refusal="full")
    value = m.registry.get_sample_value
    assert value("kvmesh_registry_leases_total", {"outcome": "granted"}) == 4
    assert value("kvmesh_registry_leases_total", {"outcome": "dropped"}) == 1
    assert value("kvmesh_registry_leases_active") == 0
    assert value("kvmesh_registry_workers", {"role": "decode"}) == 0
    assert value("kvmesh_registry_placements_total", {"prefill": "remote"}) == 1
    assert value("kvmesh_registry_refusals_total", {"reason": "full"}) == 1
    assert value("kvmesh_registry_place_seconds_count") == 2


async def test_request_context_puts_the_request_id_on_every_line_of_its_task(capsys) -> None:
    import asyncio

    from kvmesh.shared.obs import logs

    logs.setup_logging("info", "json")
    log = logs.get_logger("kvmesh.test")

    async def handle(request_id: str, started: asyncio.Event, go: asyncio.Event) -> None:
        with logs.request_context(request_id):
            started.set()
            await go.wait()  # the other request logs meanwhile: contexts must not mix
            log.info("handled")
            await asyncio.to_thread(log.info, "in a thread")

    go = asyncio.Event()
    first, second = asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(handle("req-a", first, go)),
        asyncio.create_task(handle("req-b", second, go)),
    ]
    await first.wait()
    await second.wait()
    go.set()
    await asyncio.gather(*tasks)
    log.info("outside")
    import json

    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    by_event = sorted((line["event"], line.get("request_id")) for line in lines)
    assert by_event == [
        ("handled", "req-a"),
        ("handled", "req-b"),
        ("in a thread", "req-a"),
        ("in a thread", "req-b"),
        ("outside", None),
    ]
