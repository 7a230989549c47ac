"""Metric math of ``kvmesh bench serve`` against hand-computed cases."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.serve_metrics import RequestRecord, Slo, Stats, percentile, summarize


def record(
    index: int = 0,
    send_s: float = 1.0,
    chunks: tuple[float, ...] = (1.2, 1.3, 1.5, 1.6),
    end_s: float = 1.7,
    num_output_tokens: int = 4,
    error: str | None = None,
    prompt_len: int = 10,
    output_len: int = 4,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        arrival_s=send_s,
        send_s=send_s,
        end_s=end_s,
        prompt_len=prompt_len,
        output_len=output_len,
        num_output_tokens=num_output_tokens,
        chunk_times=chunks,
        error=error,
    )


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0


def test_stats_are_in_milliseconds_and_none_without_values():
    stats = Stats.of_seconds([0.1, 0.2, 0.3])
    assert stats is not None
    assert (stats.count, stats.mean_ms, stats.p50_ms, stats.max_ms) == pytest.approx(
        (3, 200.0, 200.0, 300.0)
    )
    assert stats.p90_ms == pytest.approx(280.0)
    assert Stats.of_seconds([]) is None


def test_request_timings_follow_the_definitions():
    r = record()
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2e_s == pytest.approx(0.7)
    assert r.tpot_s == pytest.approx((0.7 - 0.2) / 3)  # (e2e - ttft) / (n - 1)
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.1])


def test_tpot_is_undefined_for_a_single_output_token():
    r = record(chunks=(1.2,), num_output_tokens=1)
    assert r.tpot_s is None and r.itl_s == []
    assert Slo(tpot_ms=1.0).is_met(r)  # nothing to violate, as vLLM counts it


def test_tpot_uses_usage_tokens_when_chunks_carry_several():
    r = record(chunks=(1.2, 1.6), end_s=1.7, num_output_tokens=6)
    assert r.tpot_s == pytest.approx(0.5 / 5)
    assert r.itl_s == pytest.approx([0.4])


def test_summary_throughputs_count_completed_requests_only():
    records = [
        record(0, prompt_len=10, num_output_tokens=4),
        record(1, prompt_len=20, num_output_tokens=4),
        record(2, chunks=(), num_output_tokens=0, error="http_429"),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.num_requests, s.num_completed, s.num_failed) == (3, 2, 1)
    assert s.total_input_tokens == 30 and s.total_output_tokens == 8
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.total_token_throughput == pytest.approx(19.0)
    assert s.itl is not None and s.itl.count == 6  # 3 gaps per completed request
    assert s.ttft is not None and s.ttft.count == 2
    assert s.goodput is None and s.num_good is None


def test_summary_counts_every_failure_by_kind():
    kinds = ["http_429", "timeout", "http_429", "connection_error", "stream_error", "incomplete"]
    records = [record(i, error=k, chunks=()) for i, k in enumerate(kinds)] + [record(9)]
    s = summarize(records, duration_s=1.0)
    assert s.failures == {
        "connection_error": 1,
        "http_429": 2,
        "incomplete": 1,
        "stream_error": 1,
        "timeout": 1,
    }
    assert s.num_failed == 6 and s.num_completed == 1
    assert sum(s.failures.values()) + s.num_completed == s.num_requests


def test_summary_counts_short_outputs():
    s = summarize([record(num_output_tokens=3, output_len=4), record()], duration_s=1.0)
    assert s.num_short == 1


def test_goodput_needs_every_given_slo_and_completion():
    fast = record(0, send_s=0.0, chunks=(0.1, 0.2, 0.3), end_s=0.3, num_output_tokens=3)
    slow_first = record(1, send_s=0.0, chunks=(0.5, 0.6), end_s=0.6, num_output_tokens=2)
    slow_tokens = record(2, send_s=0.0, chunks=(0.1, 0.9), end_s=0.9, num_output_tokens=2)
    failed = record(3, send_s=0.0, chunks=(0.1,), error="incomplete")
    records = [fast, slow_first, slow_tokens, failed]
    s = summarize(records, duration_s=4.0, slo=Slo(ttft_ms=200, tpot_ms=300))
    assert s.num_good == 1 and s.goodput == pytest.approx(0.25)
    only_ttft = summarize(records, duration_s=4.0, slo=Slo(ttft_ms=200))
    assert only_ttft.num_good == 2
    e2e = summarize(records, duration_s=4.0, slo=Slo(e2e_ms=650))
    assert e2e.num_good == 2


def test_slo_parse_maps_itl_to_tpot_and_rejects_unknown_names():
    assert Slo.parse("ttft_ms=500, itl_ms=50,e2e_ms=10000") == Slo(500.0, 50.0, 10000.0)
    assert Slo.parse("tpot_ms=20") == Slo(tpot_ms=20.0)
    assert Slo.parse("").is_empty
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=fast", "ttft_ms=0"):
        with pytest.raises(ValueError):
            Slo.parse(bad)


def test_summary_of_no_requests_is_empty_not_an_error():
    s = summarize([], duration_s=0.0)
    assert s.num_requests == 0 and s.ttft is None and s.request_throughput == 0.0
