"""kvmesh sim --validate: real runs pooled against the simulation (--repeats), and
--per-request: real and simulated requests side by side, and the
engines' means from the mesh's /metrics and from the simulation."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.engine_timings import EngineTimings, merge_scrapes
from kvmesh.sim.mesh_terms import MeshOverheads
from kvmesh.sim.per_request import by_load, format_pairs, in_flight_at, pair
from kvmesh.sim.specs import DeviceSpec, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import SimRequest


def _record(index: int, send: float, times: tuple[float, ...], prompt: int = 100) -> RequestRecord:
    return RequestRecord(
        index=index,
        arrival_s=send,
        send_s=send,
        end_s=times[-1],
        prompt_len=prompt,
        output_len=len(times),
        num_output_tokens=len(times),
        chunk_times=times,
    )


def test_in_flight_counts_requests_sent_before_and_not_finished():
    records = [
        _record(0, 0.0, (0.5, 1.0)),  # in flight over [0, 1)
        _record(1, 0.8, (1.2, 1.5)),  # sent while 0 runs
        _record(2, 1.0, (1.1, 1.3)),  # 0 has just ended; 1 runs
        _record(3, 2.0, (2.1, 2.2)),  # alone
    ]
    assert [in_flight_at(records, i) for i in range(4)] == [0, 1, 1, 0]


def test_pair_puts_ttft_and_mean_gap_side_by_side():
    real = [_record(0, 10.0, (10.2, 10.3, 10.5)), _record(1, 11.0, (11.1, 11.2))]
    sim = [_record(0, 0.0, (0.1, 0.2, 0.3)), _record(1, 1.0, (1.1, 1.3))]
    rows = pair(real, sim)
    assert rows[0].send_s == 0.0 and rows[1].send_s == pytest.approx(1.0)
    assert rows[0].real_ttft_s == pytest.approx(0.2) and rows[0].sim_ttft_s == pytest.approx(0.1)
    assert rows[0].ttft_ratio == pytest.approx(0.5)
    assert rows[0].real_gap_s == pytest.approx(0.15)  # (0.1 + 0.2) / 2
    assert rows[1].sim_gap_s == pytest.approx(0.2)


def test_pair_refuses_different_workloads():
    with pytest.raises(ValueError, match="not the same workload"):
        pair([_record(0, 0.0, (0.1,), prompt=100)], [_record(0, 0.0, (0.1,), prompt=200)])


def test_by_load_sums_ttft_of_idle_and_busy_requests_apart():
    real = [
        _record(0, 0.0, (0.2, 1.0)),  # idle: TTFT 0.2
        _record(1, 0.5, (0.9, 1.2)),  # busy: TTFT 0.4
        _record(2, 3.0, (3.3, 3.4)),  # idle: TTFT 0.3
    ]
    sim = [_record(0, 0.0, (0.1, 0.5)), _record(1, 0.5, (0.7, 0.8)), _record(2, 3.0, (3.2, 3.3))]
    idle, busy = by_load(pair(real, sim))
    assert (idle.count, busy.count) == (2, 1)
    assert idle.real_ttft_s == pytest.approx(0.5) and idle.sim_ttft_s == pytest.approx(0.3)
    assert busy.ratio == pytest.approx(0.2 / 0.4)
    assert "sent to a busy mesh: 1 requests" in format_pairs("colocated", pair(real, sim))


def test_engine_timings_are_means_between_two_scrapes():
    before = merge_scrapes(
        [
            {"kvmesh_decode_step_seconds_sum": 1.0, "kvmesh_decode_step_seconds_count": 10},
            {"kvmesh_prefill_chunk_compute_seconds_sum": 2.0},
        ]
    )
    after = merge_scrapes(
        [
            {"kvmesh_decode_step_seconds_sum": 1.5, "kvmesh_decode_step_seconds_count": 30},
            {"kvmesh_decode_step_seconds_sum": 0.5, "kvmesh_decode_step_seconds_count": 10},
            {
                "kvmesh_prefill_chunk_compute_seconds_sum": 2.6,
                "kvmesh_prefill_chunk_compute_seconds_count": 4,
            },
        ]
    )
    t = EngineTimings.between(before, after)
    assert t.home_steps == 30 and t.home_step_s == pytest.approx(1.0 / 30)  # (2.0 - 1.0) / 30
    assert t.prefill_chunks == 4 and t.prefill_chunk_s == pytest.approx(0.15)
    assert t.prefill_jobs == 0 and t.prefill_queue_s is None


def test_simulated_timings_count_engine_steps_chunks_and_queue_waits():
    # steps cost 10 ms fixed, prefill chunks 10 more; one prefill worker, so the second job
    # waits for the first one's three hand-off chunks (64 + 48 + 16 tokens: 60 ms)
    cost = CostModel(
        load_model("kvmesh-tiny"),
        DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=0.01, chunk_overhead_s=0.01),
    )
    topology = Topology("disagg", 1, 1, chunk_tokens=64, kv_capacity_tokens=10_000)
    result = simulate(topology, cost, [SimRequest(0.0, 128, 3), SimRequest(0.0, 64, 3)])
    t = result.timings
    assert t is not None
    assert t.prefill_chunks == 4 and t.prefill_chunk_s == pytest.approx(0.02)
    assert t.prefill_jobs == 2 and t.prefill_queue_s == pytest.approx((0.0 + 0.06) / 2)
    assert t.home_step_s == pytest.approx(0.01)  # decode steps: the fixed cost alone


def test_long_prompt_check_compares_median_ttft_with_the_simulated_one():
    from kvmesh.sim.overheads import check_long

    # a 1024-token prompt in 512-token steps of 10 ms each, reached 5 ms after it was sent
    cost = CostModel(
        load_model("kvmesh-tiny"),
        DeviceSpec(
            "fixed",
            1e30,
            1e30,
            1e30,
            1e30,
            step_overhead_s=0.01,
            mesh=MeshOverheads(request_s=0.005),
        ),
    )
    measured = [
        _record(i, 0.0, (ttft, ttft + 0.01), prompt=1024)
        for i, ttft in enumerate((0.05, 0.04, 0.06))
    ]
    (check,) = check_long(
        cost,
        {"colocated": measured},
        lambda mode, c: Topology(mode, 1, chunk_tokens=512, kv_capacity_tokens=10_000),
    )
    assert check.label == "colocated TTFT of a 1024-token prompt"
    assert check.measured_s == pytest.approx(0.05)
    assert check.simulated_s == pytest.approx(0.005 + 2 * 0.01)
    assert check.relative == pytest.approx(-0.5)


def _ttfts_run(ttfts: tuple[float, ...], gap: float = 0.01) -> list[RequestRecord]:
    return [_record(i, 0.0, (t, t + gap, t + 2 * gap)) for i, t in enumerate(ttfts)]


def test_pooled_summary_takes_percentiles_over_every_runs_records():
    from kvmesh.sim.validate import pooled_summary

    one = _ttfts_run((0.010, 0.020, 0.030))
    two = _ttfts_run((0.100, 0.110, 0.120, 0.130, 0.140))
    s = pooled_summary([(one, 1.0), (two, 3.0)])
    assert s.num_completed == 8 and s.duration_s == 4.0
    # the median of all eight TTFTs, not the mean of the runs' medians (70 ms)
    assert s.ttft.p50_ms == pytest.approx(105.0)
    assert s.itl.count == 16
    with pytest.raises(ValueError):
        pooled_summary([])


def test_within_counts_ratios_inside_the_tolerance():
    from kvmesh.sim.validate import within

    values = {"a": 0.75, "b": 1.25, "c": 0.74, "d": 1.26, "e": None, "f": 1.0}
    assert within(values) == 3
    assert within(values, tolerance=0.5) == 5


def _comparison(runs: list[list[RequestRecord]], timings: list[EngineTimings | None]):
    from kvmesh.sim.validate import RealRun, comparison

    cost = CostModel(
        load_model("kvmesh-tiny"), DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=0.01)
    )
    sim = simulate(
        Topology("colocated", 1, kv_capacity_tokens=10_000),
        cost,
        [SimRequest(0.0, 100, 3), SimRequest(5.0, 100, 3), SimRequest(10.0, 100, 3)],
    )
    real = [RealRun(r, 12.0, t) for r, t in zip(runs, timings, strict=True)]
    return comparison("colocated", real, sim), sim


def test_comparison_pools_the_real_runs_and_keeps_each_runs_ratios():
    fast = _ttfts_run((0.010, 0.010, 0.010))
    slow = _ttfts_run((0.020, 0.020, 0.040))
    t1 = EngineTimings(10, 0.010, 0, None, 0, None)
    t2 = EngineTimings(30, 0.020, 0, None, 0, None)
    c, sim = _comparison([fast, slow], [t1, t2])
    # the simulation steps are 10 ms: TTFT 10 ms, gaps 10 ms
    assert c.sim_once.ttft.p50_ms == pytest.approx(10.0)
    # counted once per real run, so both sides' percentiles are over six requests
    assert c.sim.num_completed == 6 and c.real.num_completed == 6
    assert c.sim.ttft.p50_ms == pytest.approx(10.0)
    assert c.real.ttft.p50_ms == pytest.approx(15.0)
    assert c.ratios()["TTFT p50"] == pytest.approx(10 / 15)
    per_run = c.run_ratios()
    assert [r["TTFT p50"] for r in per_run] == pytest.approx([1.0, 0.5])
    assert [r["ITL p50"] for r in per_run] == pytest.approx([1.0, 1.0])
    assert c.real_records == (*fast, *slow)
    assert c.sim_records == sim.records
    assert c.real_timings.home_steps == 40
    assert c.real_timings.home_step_s == pytest.approx((10 * 0.010 + 30 * 0.020) / 40)
    # a run whose /metrics were unread leaves the pooled timings unknown
    c2, _ = _comparison([fast, slow], [t1, None])
    assert c2.real_timings is None


def test_comparison_of_one_run_is_the_plain_comparison():
    from kvmesh.loadgen.serve_metrics import summarize
    from kvmesh.sim.validate import ratios

    run = _ttfts_run((0.010, 0.030, 0.020))
    c, sim = _comparison([run], [None])
    assert c.real == summarize(run, 12.0)
    assert c.sim == sim.summary == c.sim_once
    assert c.ratios() == ratios(summarize(run, 12.0), sim.summary) == c.run_ratios()[0]


def test_validation_tables_show_each_run_the_range_and_the_pooled_count():
    import json

    from kvmesh.sim.validate import format_comparisons, format_runs, records_json

    c, _ = _comparison([_ttfts_run((0.010,) * 3), _ttfts_run((0.020, 0.020, 0.040))], [None, None])
    runs = format_runs([c])
    assert "| colocated | 1 | 1.00x |" in runs
    assert "| colocated | 2 | 0.50x |" in runs
    assert "| colocated | range | 0.50-1.00x |" in runs
    table = format_comparisons([c])
    assert "| colocated | sim/real | 0.67x |" in table
    assert "within 25 % (the real side pooled over 2 runs): colocated" in table
    by_mode = json.loads(records_json([c]))["colocated"]
    assert [r["run"] for r in by_mode["real"]] == [0, 0, 0, 1, 1, 1]
    assert len(by_mode["sim"]) == 3


def test_compare_refuses_no_repeats():
    from kvmesh.sim.validate import serve

    with pytest.raises(ValueError, match="at least 1"):
        serve(None, ("colocated",), repeats=0)  # type: ignore[arg-type]
