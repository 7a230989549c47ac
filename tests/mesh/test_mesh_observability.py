"""One request through a real ``kvmesh up`` mesh: every service's metrics endpoint answers and
counts it, and every service's log names its request id (one ``grep`` follows it)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.mesh_checks import scrape
from support.proc_tree import reaped
from test_up import chat, launch, wait_for_line

from kvmesh.commands.up_config import UpConfig
from kvmesh.commands.up_plan import plan, with_metrics_ports


def test_with_metrics_ports_gives_each_worker_its_port_and_leaves_the_router() -> None:
    specs = plan(UpConfig(prefill=1, decode=2), "nats://127.0.0.1:4333", 8123)
    ports = {s.name: 9000 + i for i, s in enumerate(specs) if s.tier != "router"}
    for spec in with_metrics_ports(specs, ports):
        if spec.tier == "router":
            assert "--metrics-port" not in spec.argv  # /metrics on its API port
        else:
            assert spec.argv[-2:] == ("--metrics-port", str(ports[spec.name]))


def metrics_urls(out: Path) -> dict[str, str]:
    """What `kvmesh up` printed: `kvmesh up: metrics: NAME URL, NAME URL, ...`."""
    line = next(x for x in out.read_text().splitlines() if x.startswith("kvmesh up: metrics: "))
    pairs = line.removeprefix("kvmesh up: metrics: ").split(", ")
    return dict(pair.split(" ", 1) for pair in pairs)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_request_shows_in_every_services_metrics_and_logs(tmp_path: Path) -> None:
    proc, out, err, port, _ = launch(
        tmp_path, "--local-prefill-threshold", "16", "--log-level", "debug", "--log-format", "json"
    )
    with reaped(proc):
        wait_for_line(proc, out, "kvmesh up: metrics:", timeout_s=400)
        urls = metrics_urls(out)
        assert set(urls) == {
            "prefill-queue-0",
            "kv-registry-0",
            "decode-0",
            "prefill-0",
            "router-0",
        }
        # ignore_eos: a sampled end of text as the prefill's first token would leave the decode
        # worker nothing to generate (kvmesh-tiny samples at temperature 1)
        reply = chat(
            port, "tell me about disaggregated serving " * 8, max_tokens=4, ignore_eos=True
        )
        request_id = reply["id"]
        router = scrape(urls["router-0"])
        registry = scrape(urls["kv-registry-0"])
        prefill = scrape(urls["prefill-0"])
        decode = scrape(urls["decode-0"])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, err.read_text()[-2000:]
    assert router["kvmesh_router_requests_total"] == 1
    assert router["kvmesh_router_time_to_first_token_seconds_count"] == 1
    assert registry["kvmesh_registry_placements_total"] == 1
    assert registry["kvmesh_registry_leases_total"] >= 1  # granted (and completed)
    assert prefill["kvmesh_prefill_jobs_total"] == 1
    assert prefill["kvmesh_prefill_kv_bytes_written_total"] > 0
    assert prefill["kvmesh_prefill_chunk_compute_seconds_count"] >= 1
    assert decode["kvmesh_decode_generated_tokens_total"] >= 1
    assert decode["kvmesh_decode_step_seconds_count"] >= 1

    loggers: set[str] = set()
    for line in err.read_text(errors="replace").splitlines():
        if request_id not in line or not line.startswith("{"):
            continue
        event = json.loads(line)
        assert event.get("request_id", "").startswith(request_id), event  # a field, not prose
        loggers.add(event["logger"])
    services = {name.split(".")[2] for name in loggers if name.startswith("kvmesh.services.")}
    assert services == {"router", "kv_registry", "prefill", "decode"}, loggers
