"""The server-side breakdown of a run, from two hand-written /metrics scrapes."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.prom_text import totals as parse_prometheus
from kvmesh.loadgen.server_breakdown import ServerBreakdown
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport

BEFORE = """\
# HELP kvmesh_router_time_to_first_token_seconds Request arrival to first output token.
# TYPE kvmesh_router_time_to_first_token_seconds histogram
kvmesh_router_time_to_first_token_seconds_bucket{le="1.0"} 1
kvmesh_router_time_to_first_token_seconds_sum 2.0
kvmesh_router_time_to_first_token_seconds_count 2
kvmesh_router_place_seconds_sum 0.5
kvmesh_router_place_seconds_count 2
kvmesh_router_requests_total{endpoint="completions",status="200"} 2
kvmesh_router_requests_total{endpoint="chat",status="200"} 1
"""

AFTER = """\
kvmesh_router_time_to_first_token_seconds_sum 14.0
kvmesh_router_time_to_first_token_seconds_count 6
kvmesh_router_place_seconds_sum 2.5
kvmesh_router_place_seconds_count 6
kvmesh_router_prefill_queue_seconds_sum 3.0
kvmesh_router_prefill_queue_seconds_count 3
kvmesh_router_prefill_compute_seconds_sum 4.5
kvmesh_router_prefill_compute_seconds_count 3
kvmesh_router_kv_exposed_transfer_seconds_sum 0.3
kvmesh_router_kv_exposed_transfer_seconds_count 3
not a sample line
"""


def test_parse_prometheus_sums_labelled_series_and_skips_buckets_and_comments() -> None:
    samples = parse_prometheus(BEFORE)
    assert samples["kvmesh_router_requests_total"] == 3
    assert samples["kvmesh_router_time_to_first_token_seconds_sum"] == 2.0
    assert not any(name.endswith("_bucket") for name in samples)
    assert parse_prometheus("garbage\n# comment\nx_total notanumber\n") == {}


def test_breakdown_between_scrapes_is_the_mean_of_the_run_only() -> None:
    server = ServerBreakdown.between(parse_prometheus(BEFORE), parse_prometheus(AFTER))
    assert server is not None
    assert server.requests == 4
    assert server.ttft_s == pytest.approx(3.0)  # (14 - 2) / (6 - 2)
    assert server.place_s == pytest.approx(0.5)  # (2.5 - 0.5) / 4
    assert server.prefill_jobs == 3
    assert server.prefill_queue_s == pytest.approx(1.0)
    assert server.prefill_compute_s == pytest.approx(1.5)
    assert server.exposed_transfer_s == pytest.approx(0.1)
    assert "3 remote prefills: queue 1.00 s, compute 1.50 s" in server.line()


def test_breakdown_without_remote_prefills_leaves_them_out() -> None:
    server = ServerBreakdown.between({}, parse_prometheus(BEFORE))
    assert server is not None
    assert server.prefill_jobs == 0 and server.prefill_compute_s is None
    assert "remote prefills" not in server.line()


def test_breakdown_of_a_server_without_kvmesh_metrics_is_absent() -> None:
    assert ServerBreakdown.between({}, parse_prometheus("http_requests_total 5\n")) is None


def test_breakdown_reads_what_the_router_renders() -> None:
    metrics = RouterMetrics()
    before = parse_prometheus(metrics.render())
    metrics.ttft.observe(2.0)
    metrics.place.observe(0.25)
    metrics.record_prefill(PrefillReport("r", "prefill-0", 1.0, 3.0, 0.5, 0.25, 4))
    server = ServerBreakdown.between(before, parse_prometheus(metrics.render()))
    assert server == ServerBreakdown(1, 2.0, 0.25, 1, 1.0, 3.0, 0.25)


def test_parse_prometheus_reads_quoted_braces_timestamps_and_skips_created() -> None:
    text = (
        'kvmesh_router_aborts_total{reason="bad {x}, y"} 2.0\n'
        'kvmesh_router_aborts_total{reason="client disconnected"} 1.0 1700000000000\n'
        'kvmesh_router_aborts_created{reason="client disconnected"} 1.7e9\n'
    )
    assert parse_prometheus(text) == {"kvmesh_router_aborts_total": 3.0}
