"""kvmesh sim --validate --per-request: real and simulated requests side by side, and the
engines' means from the mesh's /metrics and from the simulation."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.sim.cluster import simulate
from kvmesh.loadgen.sim.cost import CostModel
from kvmesh.loadgen.sim.engine_timings import EngineTimings, merge_scrapes
from kvmesh.loadgen.sim.per_request import by_load, format_pairs, in_flight_at, pair
from kvmesh.loadgen.sim.specs import DeviceSpec, load_model
from kvmesh.loadgen.sim.topology import Topology
from kvmesh.loadgen.sim.workload import SimRequest


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
    from kvmesh.loadgen.sim.overheads import check_long

    # a 1024-token prompt in 512-token steps of 10 ms each, reached 5 ms after it was sent
    cost = CostModel(
        load_model("kvmesh-tiny"),
        DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=0.01, request_overhead_s=0.005),
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
