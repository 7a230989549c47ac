"""Where the first token's time goes: the router's per-request stages (services/router/timings.py),
the decode worker's share (services/decode/first_token.py), the benchmark's join and per-role CPU
(loadgen/ttft_breakdown.py, loadgen/proc_sched.py), and ``--compare``'s targets and baseline
(loadgen/compare_targets.py, serve_report.comparison_text)."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from kvmesh.loadgen import proc_sched
from kvmesh.loadgen.compare_targets import Target, parse_budgets, parse_targets
from kvmesh.loadgen.proc_sched import SchedTimes
from kvmesh.loadgen.serve_metrics import RequestRecord, Slo, summarize
from kvmesh.loadgen.serve_report import RunResult, best_colocated, comparison_text
from kvmesh.loadgen.ttft_breakdown import build, format_breakdown
from kvmesh.services.decode.first_token import FirstTokenClock
from kvmesh.services.router.timings import STAGES, TimingLog, TimingStamps

# ---- the router's stages ---------------------------------------------------------------------


def test_remote_prefill_stages_add_up_to_the_ttft() -> None:
    stamps = TimingStamps(arrived_at=100.0, place_started_at=101.0, placed_at=101.5)
    stamps.remote_queue_s, stamps.remote_compute_s, stamps.remote_transfer_s = 2.0, 3.0, 0.25
    stamps.decode_wait_s = 0.5
    t = stamps.timing("cmpl-1", first_token_at=108.0, num_prompt_tokens=1500)
    assert t is not None and not t.local_prefill
    assert (t.admission_s, t.place_s, t.prefill_queue_s, t.prefill_s) == (1.0, 0.5, 2.0, 3.0)
    assert (t.transfer_s, t.admit_s) == (0.25, 0.5)
    assert t.relay_s == pytest.approx(0.75)
    assert sum(getattr(t, s) for s in STAGES) == pytest.approx(t.ttft_s) == 8.0


def test_local_prefill_takes_the_decode_workers_wait_and_prefill() -> None:
    stamps = TimingStamps(arrived_at=0.0, place_started_at=0.0, placed_at=0.1, local_prefill=True)
    stamps.decode_wait_s, stamps.decode_prefill_s = 4.0, 2.5
    stamps.remote_queue_s = 9.0  # a report of an earlier attempt does not count
    t = stamps.timing("cmpl-2", first_token_at=7.0, num_prompt_tokens=10)
    assert t is not None and t.local_prefill
    assert (t.prefill_queue_s, t.prefill_s, t.transfer_s, t.admit_s) == (4.0, 2.5, 0.0, 0.0)
    assert t.relay_s == pytest.approx(0.4)


def test_a_local_wait_that_began_during_placement_gives_the_overlap_back() -> None:
    stamps = TimingStamps(arrived_at=0.0, place_started_at=0.0, placed_at=0.5, local_prefill=True)
    stamps.decode_wait_s, stamps.decode_prefill_s = 1.0, 2.0  # accepted at 0.3 s
    t = stamps.timing("cmpl-3", first_token_at=3.3, num_prompt_tokens=10)
    assert t is not None
    assert (t.place_s, t.prefill_queue_s, t.prefill_s, t.relay_s) == pytest.approx(
        (0.5, 0.8, 2.0, 0)
    )
    assert sum(getattr(t, s) for s in STAGES) == pytest.approx(t.ttft_s)


def test_a_request_never_placed_has_no_timing_and_the_log_is_bounded() -> None:
    assert TimingStamps(arrived_at=0.0).timing("x", 1.0, 1) is None
    log = TimingLog(capacity=2)
    for i in range(3):
        stamps = TimingStamps(0.0, 0.0, 0.0)
        log.add(stamps.timing(f"r{i}", 1.0, 1))  # type: ignore[arg-type]
    body = log.to_json()
    assert [r["request_id"] for r in body["requests"]] == ["r1", "r2"]
    assert body["stages"] == list(STAGES)
    with pytest.raises(ValueError, match="at least one"):
        TimingLog(0)


# ---- the decode worker's share ----------------------------------------------------------------


def test_first_token_clock_times_the_wait_and_the_chunked_prefill() -> None:
    clock = FirstTokenClock()
    clock.accepted("a", 10.0)
    clock.accepted("b", 10.5)
    computed = {"a": 0, "b": 0}
    clock.after_step(11.0, 11.2, computed.get, [])  # neither was scheduled
    computed["a"] = 512
    clock.after_step(12.0, 12.4, computed.get, [])  # a's first chunk
    assert clock.take("a") == (0.0, 0.0)  # no first token yet: nothing to hand out
    computed["a"], computed["b"] = 1000, 512
    clock.after_step(13.0, 13.5, computed.get, ["a"])  # a's last chunk and first token
    assert clock.take("a") == pytest.approx((2.0, 1.5))
    assert clock.take("a") == (0.0, 0.0)  # handed out once
    clock.forget("b")  # aborted before its first token
    assert len(clock) == 0


def test_first_token_in_the_first_step_counts_that_step_as_prefill() -> None:
    clock = FirstTokenClock()
    clock.accepted("a", 1.0)
    clock.after_step(2.0, 2.25, {"a": 30}.get, ["a"])
    assert clock.take("a") == pytest.approx((1.0, 0.25))


# ---- the benchmark's join and per-role CPU ----------------------------------------------------


def record(i: int, ttft_s: float, rid: str) -> RequestRecord:
    return RequestRecord(i, 0.0, 0.0, ttft_s + 1, 8, 2, 2, (ttft_s, ttft_s + 1), response_id=rid)


def timing(rid: str, ttft_s: float, queue_s: float, local: bool = False) -> dict:
    rest = ttft_s - queue_s
    return {"request_id": rid, "local_prefill": local, "ttft_s": ttft_s,
            "admission_s": 0.0, "place_s": 0.0, "prefill_queue_s": queue_s, "prefill_s": rest,
            "transfer_s": 0.0, "admit_s": 0.0, "relay_s": 0.0}  # fmt: skip


def test_breakdown_joins_by_response_id_and_adds_the_client_side() -> None:
    records = [record(0, 2.0, "a"), record(1, 4.5, "b"), record(2, 1.0, "")]
    timings = [timing("a", 1.75, 1.0), timing("b", 4.0, 3.0, local=True), timing("zz", 9, 9)]
    roles = {"decode": SchedTimes(5.0, 1.0)}
    b = build(records, timings, roles, duration_s=10.0)
    assert (b.num_requests, b.num_local) == (2, 1)
    assert b.stages["prefill_queue_s"].mean_ms == pytest.approx(2000)
    assert b.stages["client_s"].p50_ms == pytest.approx(375)  # 250 ms and 500 ms
    text = format_breakdown("disagg", b)
    assert "prefill queue" in text and "client side" in text
    assert "decode" in text and "0.50 cores" in text and "(0.10)" in text
    assert b.to_json()["roles"]["decode"] == {"cpu_s": 5.0, "runnable_waiting_s": 1.0}


def test_breakdown_without_router_timings_keeps_the_roles_only() -> None:
    b = build([record(0, 1.0, "a")], None, {"server": SchedTimes(3.0, 0.5)}, 6.0)
    assert b.stages == {} and b.num_requests == 0
    text = format_breakdown("llama-server", b)
    assert "where the first token" not in text and "server" in text


def test_schedstat_of_this_process_and_the_listener_on_a_port() -> None:
    assert proc_sched.parse_schedstat("2000000000 500000000 7\n") == SchedTimes(2.0, 0.5)
    with pytest.raises(ValueError):
        proc_sched.parse_schedstat("12")
    mine = proc_sched.process_times(os.getpid())
    assert mine is not None and mine.cpu_s > 0
    stop = threading.Event()
    spin = threading.Thread(target=lambda: stop.wait(0.2))
    spin.start()
    roles = proc_sched.read_roles({"me": [os.getpid()], "gone": [2**22 + 7]})
    stop.set()
    spin.join()
    assert set(roles) == {"me"}  # a process that is not there is left out
    assert proc_sched.role_deltas(
        {"me": SchedTimes(1, 1)}, {"me": SchedTimes(3, 2), "x": SchedTimes()}
    ) == {"me": SchedTimes(2, 1)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert proc_sched.pid_listening_on(port) == os.getpid()
    assert proc_sched.pid_listening_on(port) is None


# ---- --compare's targets and its colocated baseline -------------------------------------------


def test_compare_targets_sweep_colocated_and_name_outside_servers() -> None:
    targets = parse_targets(
        "colocated,disagg,llama=http://127.0.0.1:8080/,http://localhost:9000", (256, 1024)
    )
    assert [t.label for t in targets] == [
        "colocated@256", "colocated@1024", "disagg", "llama", "localhost:9000"
    ]  # fmt: skip
    assert targets[1] == Target("colocated@1024", "colocated", budget=1024)
    assert targets[3].url == "http://127.0.0.1:8080" and targets[3].mode is None
    assert parse_targets("colocated") == (Target("colocated", "colocated"),)
    assert parse_budgets("") == () and parse_budgets("512, 2048") == (512, 2048)
    for bad in ("colocated,colocated", "turbo", "x=nothttp"):
        with pytest.raises(ValueError):
            parse_targets(bad)
    with pytest.raises(ValueError, match="repeats"):
        parse_budgets("512,512")


def run_of(label: str, ttft_s: float, gap_s: float, slo: Slo) -> RunResult:
    chunks = (ttft_s, ttft_s + gap_s, ttft_s + 2 * gap_s)
    records = [RequestRecord(i, 0.0, 0.0, chunks[-1], 8, 3, 3, chunks) for i in range(2)]
    return RunResult(label, 0.4, summarize(records, 1.0, slo), tuple(records))


def test_the_best_colocated_budget_is_the_baseline_of_the_comparison() -> None:
    slo = Slo(ttft_ms=1000)
    results = [
        run_of("colocated@256", 2.0, 0.05, slo),  # misses the SLO: no goodput
        run_of("colocated@1024", 0.5, 0.05, slo),
        run_of("colocated@2048", 0.8, 0.05, slo),  # same goodput, slower TTFT
        run_of("disagg", 0.6, 0.01, slo),
        run_of("llama", 0.4, 0.08, slo),
    ]
    assert best_colocated(results, 0.4) is results[1]
    text = comparison_text(results)
    assert text.startswith("colocated token-budget sweep:")
    assert "best colocated at 0.4 req/s: colocated@1024" in text
    final = text.split("\n\n")[1].splitlines()
    assert final[1].split()[2:4] == ["colocated", "(best)"]
    assert [line.split()[0] for line in final[2:]] == [
        "0.4", "0.4", "disagg/colocated", "llama/colocated"
    ]  # fmt: skip
