"""The mesh's overheads in the simulator (loop, per token, per request, disagg hand-off), the
engine's hand-off chunks and admission between steps, and their fit to a probe."""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque

import pytest
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel, Slice
from kvmesh.sim.mesh_terms import Jitter, MeshOverheads
from kvmesh.sim.overheads import fit_overheads, simulate_probe
from kvmesh.sim.probe import ProbeRecords
from kvmesh.sim.probe_figures import OverheadFitError, ProbeFigures, jitter_of, steady_gap_s
from kvmesh.sim.specs import DeviceSpec, SpecError, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.validate import mesh_topology
from kvmesh.sim.worker import SimSeq, Worker
from kvmesh.sim.workload import SimRequest
from support.sim_probe_fakes import cpu_like, fixed_steps, simulated_probe, slow_link_disagg

TINY = load_model("kvmesh-tiny")


def _gaps(record: RequestRecord) -> list[float]:
    return record.itl_s


def test_loop_step_adds_loop_and_per_token_overheads():
    cost = fixed_steps(
        mesh=MeshOverheads(
            loop_s=0.002, token_s=0.0005, colocated_loop_s=0.003, colocated_token_s=0.001
        )
    )
    slices = [Slice(1, 100)] * 4
    engine = cost.step(slices)
    loop = cost.loop_step(slices, num_tokens=4)
    assert loop.overhead_s == pytest.approx(engine.overhead_s + 0.002 + 4 * 0.0005)
    assert loop.roofline_s == engine.roofline_s
    colocated = cost.loop_step(slices, num_tokens=4, is_colocated=True)
    assert colocated.overhead_s == pytest.approx(engine.overhead_s + 0.003 + 4 * 0.001)


def test_request_overhead_delays_the_first_token_not_the_gaps():
    requests = [SimRequest(0.0, 100, 5)]
    topology = Topology("colocated", 1, kv_capacity_tokens=10_000)
    plain = simulate(topology, fixed_steps(), requests).records[0]
    slow = simulate(topology, fixed_steps(mesh=MeshOverheads(request_s=0.3)), requests).records[0]
    assert slow.ttft_s == pytest.approx(plain.ttft_s + 0.3)
    assert _gaps(slow) == pytest.approx(_gaps(plain))


def test_handoff_overhead_delays_disagg_first_token_only():
    requests = [SimRequest(0.0, 100, 5)]
    topology = Topology("disagg", 1, 1, chunk_tokens=512, kv_capacity_tokens=10_000)
    plain = simulate(topology, fixed_steps(), requests).records[0]
    slow = simulate(topology, fixed_steps(mesh=MeshOverheads(handoff_s=0.2)), requests).records[0]
    assert slow.ttft_s == pytest.approx(plain.ttft_s + 0.2)
    # colocated has no hand-off
    colocated = Topology("colocated", 1, kv_capacity_tokens=10_000)
    assert simulate(colocated, fixed_steps(mesh=MeshOverheads(handoff_s=0.2)), requests).records[
        0
    ].ttft_s == pytest.approx(simulate(colocated, fixed_steps(), requests).records[0].ttft_s)


def test_colocated_gap_is_step_plus_loop_plus_token_cost_per_sequence():
    requests = [SimRequest(0.0, 16, 20) for _ in range(4)]
    topology = Topology("colocated", 1, kv_capacity_tokens=10_000)
    # the decode worker's terms are not the colocated worker's
    cost = fixed_steps(
        mesh=MeshOverheads(colocated_loop_s=0.004, colocated_token_s=0.001, loop_s=1.0)
    )
    result = simulate(topology, cost, requests)
    # the first request's step starts alone, the other three join the next; then four decode
    for record in result.records:
        assert _gaps(record)[2:15] == pytest.approx([0.01 + 0.004 + 4 * 0.001] * 13)


def test_disagg_first_token_waits_for_the_decode_step_in_flight():
    # decode steps of 1 s; a stream decodes from t=1 while a second prompt lands at 3.5
    cost = CostModel(TINY, DeviceSpec("slow", 1e30, 1e30, 1e30, 1e30, step_overhead_s=1.0))
    topology = Topology("disagg", 1, 1, chunk_tokens=512, kv_capacity_tokens=10_000)
    result = simulate(topology, cost, [SimRequest(0.0, 16, 10), SimRequest(2.5, 16, 3)])
    stream, late = result.records
    assert stream.ttft_s == pytest.approx(1.0)  # the decode worker was idle: admitted at once
    # its prefill ended at 3.5, during the decode step [3, 4]: admitted (first token) at 4
    assert late.chunk_times[0] == pytest.approx(4.0)


def test_prefill_hand_off_chunks_are_whole_blocks_then_at_most_one_block():
    worker = Worker(0, "prefill", chunk_tokens=512, max_num_seqs=1, block_tokens=16)
    queue = deque([SimSeq(0, 0.0, 1000, 1)])
    chunks = []
    while batch := worker.plan(queue):
        chunks += [w.num_new for w in batch]
        worker.complete(batch, 0.0)
    assert chunks == [512, 480, 8]  # as shared/engine/scheduler.py's _chunk_size cuts them


def test_prefill_job_holds_its_slot_until_its_last_write_lands():
    # 1 s a step; a 1000-token chunk's KV takes 0.5 s on the link; one job at a time
    cost, topology = slow_link_disagg()
    requests = [SimRequest(0.0, 1000, 1), SimRequest(0.0, 1000, 1)]
    first, second = simulate(topology, cost, requests).records
    assert first.ttft_s == pytest.approx(1.5)
    # the second job starts when the first one's write has landed (1.5), not when it computed
    assert second.ttft_s == pytest.approx(1.5 + 1.0 + 0.5)


def test_disagg_topology_refuses_a_chunk_smaller_than_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        Topology("disagg", 1, 1, chunk_tokens=8, block_tokens=16)
    Topology("disagg", 1, 1, chunk_tokens=8, block_tokens=None)  # plain chunks: no blocks


def test_pacing_spaces_colocated_steps():
    requests = [SimRequest(0.0, 16, 10)]
    topology = Topology("colocated", 1, kv_capacity_tokens=10_000, decode_pacing_s=0.05)
    record = simulate(topology, fixed_steps(), requests).records[0]
    assert _gaps(record) == pytest.approx([0.05] * 9)


def test_steady_gap_is_the_mean_of_the_second_half_whatever_the_coalescing():
    # tokens every 10 ms, but read in pairs by a busy client: gaps of 0 and 20 ms
    times = tuple(0.1 + 0.02 * (i // 2) for i in range(10))
    record = RequestRecord(0, 0.0, 0.0, times[-1], 16, 10, 10, times)
    assert steady_gap_s([record]) == pytest.approx((times[-1] - times[5]) / 4)
    # pooled: a second stream of 4 gaps of 50 ms weighs as its gaps do
    other = RequestRecord(1, 0.0, 0.0, 1.0, 16, 9, 9, tuple(0.6 + 0.05 * i for i in range(9)))
    pooled = (times[-1] - times[5] + 0.2) / 8
    assert steady_gap_s([record, other]) == pytest.approx(pooled)
    with pytest.raises(OverheadFitError):
        steady_gap_s([RequestRecord(0, 0.0, 0.0, 0.1, 16, 2, 2, (0.05, 0.1))])


def test_jitter_is_how_far_the_gaps_exceed_their_median():
    # steady gaps of 10 ms, the 99 in a hundred that follow are 10 + k/10 ms, the last 60 ms
    gaps = [0.01] * 100 + [0.01 + k * 1e-4 for k in range(1, 100)] + [0.06]
    times = (0.0, *(0.1 + sum(gaps[:i]) for i in range(len(gaps) + 1)))  # a first gap of 0.1 s
    record = RequestRecord(0, 0.0, 0.0, times[-1], 16, len(times), len(times), times)
    jitter = jitter_of([record])
    steady = sorted(record.itl_s[len(record.itl_s) // 2 :])  # the second half only
    median = steady[len(steady) // 2]
    assert jitter.max_s == pytest.approx(0.06 - median)
    assert 0 < jitter.p90_s < jitter.p99_s < jitter.max_s
    assert jitter_of([]) == Jitter()


def _jitter(p90_s: float, p99_s: float, max_s: float, role: str = "") -> MeshOverheads:
    """Mesh terms with only a role's jitter quantiles (no role: the decode worker's)."""
    return MeshOverheads(**{f"{role}_jitter" if role else "jitter": Jitter(p90_s, p99_s, max_s)})


def test_jitter_draws_follow_the_measured_quantiles():
    cost = fixed_steps(mesh=_jitter(0.002, 0.01, 0.05))
    assert cost.jitter_s(0.3) == 0.0  # up to the median
    assert cost.jitter_s(0.7) == pytest.approx(0.001)
    assert cost.jitter_s(0.9) == pytest.approx(0.002)
    assert cost.jitter_s(0.99) == pytest.approx(0.01)
    assert cost.jitter_s(0.995) == pytest.approx(0.03)
    with pytest.raises(SpecError, match="must not decrease"):
        fixed_steps(mesh=_jitter(0.01, 0.002, 0.05))


def test_each_role_draws_its_own_jitter():
    cost = fixed_steps(
        mesh=MeshOverheads(
            jitter=Jitter(0.002, 0.01, 0.05), colocated_jitter=Jitter(0.004, 0.02, 0.1)
        )
    )
    assert cost.jitter_s(0.9) == pytest.approx(0.002)
    assert cost.jitter_s(0.9, "decode") == pytest.approx(0.002)
    assert cost.jitter_s(0.9, "colocated") == pytest.approx(0.004)
    assert cost.jitter_s(0.995, "colocated") == pytest.approx(0.06)
    with pytest.raises(SpecError, match=r"mesh\.colocated_jitter\.p90_s"):
        fixed_steps(mesh=_jitter(0.01, 0.002, 0.05, "colocated"))


def test_loop_steps_jitter_by_seeded_draws():
    cost = fixed_steps(mesh=_jitter(0.002, 0.01, 0.05, "colocated"))
    topology = Topology("colocated", 1, kv_capacity_tokens=10_000)
    gaps = _gaps(simulate(topology, cost, [SimRequest(0.0, 16, 2000)]).records[0])
    assert min(gaps) == pytest.approx(0.01)  # no jitter below the median
    excess = sorted(g - 0.01 for g in gaps)
    assert excess[len(excess) // 2] == pytest.approx(0.0, abs=1e-4)
    assert excess[int(0.9 * len(excess))] == pytest.approx(0.002, rel=0.2)
    assert max(excess) <= 0.05 + 1e-9
    again = _gaps(simulate(topology, cost, [SimRequest(0.0, 16, 2000)]).records[0])
    assert again == gaps  # the same draws every run
    # the decode worker's jitter is not the colocated worker's
    steady = fixed_steps(mesh=_jitter(0.002, 0.01, 0.05))
    flat = _gaps(simulate(topology, steady, [SimRequest(0.0, 16, 200)]).records[0])
    assert max(flat) == pytest.approx(0.01)


def test_jitter_is_against_each_requests_own_median_and_pace_holds_the_rest():
    """Two requests, one twice as slow throughout, each with one late step: the step jitter is
    the late step over its own request's median (the slow request's every step would be
    jitter against the common median), and their pace is 2/3 and 4/3 of the mean."""

    def record(index: int, gap: float) -> RequestRecord:
        gaps = [gap] * 39 + [gap + 0.005]
        times = (0.0, *(0.05 + sum(gaps[:i]) for i in range(len(gaps) + 1)))
        return RequestRecord(index, 0.0, 0.0, times[-1], 16, len(times), len(times), times)

    records = [record(0, 0.002), record(1, 0.004)]
    jitter = jitter_of(records)
    assert jitter.max_s == pytest.approx(0.005)
    assert jitter.p90_s == pytest.approx(0.0, abs=1e-12)
    # steady gaps (the second half's means) about 2.2 and 4.2 ms: the knots interpolate
    # between them, a distribution whose mean is their mean
    steady = [statistics.mean(r.itl_s[len(r.itl_s) // 2 :]) for r in records]
    mean = sum(steady) / 2
    assert jitter.pace[0] == pytest.approx(steady[0] / mean)
    assert jitter.pace[2] == pytest.approx(1.0)
    assert jitter.pace[4] == pytest.approx(steady[1] / mean)
    assert jitter_of([record(0, 0.002)]).pace == (1.0,) * 5  # one request: no spread


def test_pace_knots_have_mean_one_and_draws_follow_them():
    from kvmesh.sim.probe_figures import pace_knots

    knots = pace_knots([1.0, 1.2, 1.5, 2.0, 3.0, 1.1, 1.3, 1.4, 1.6, 2.5])
    assert list(knots) == sorted(knots)
    mean = 0.1 * (knots[0] + knots[1]) / 2 + 0.4 * (knots[1] + knots[2]) / 2
    mean += 0.4 * (knots[2] + knots[3]) / 2 + 0.1 * (knots[3] + knots[4]) / 2
    assert mean == pytest.approx(1.0)
    assert knots[4] / knots[0] == pytest.approx(3.0)
    cost = fixed_steps(mesh=MeshOverheads(jitter=Jitter(pace=tuple(knots))))
    assert cost.pace(0.0) == pytest.approx(knots[0])
    assert cost.pace(0.3) == pytest.approx((knots[1] + knots[2]) / 2)
    assert cost.pace(1.0) == pytest.approx(knots[4])
    assert cost.pace(0.5, "colocated") == 1.0  # the colocated worker's own: none given
    with pytest.raises(SpecError, match="must not decrease"):
        fixed_steps(mesh=MeshOverheads(jitter=Jitter(pace=(1.0, 2.0, 1.0, 1.0, 1.0))))
    with pytest.raises(SpecError, match=r"colocated_jitter\.pace must start > 0"):
        fixed_steps(mesh=MeshOverheads(colocated_jitter=Jitter(pace=(0.0, 1.0, 1.0, 1.0, 1.0))))


def test_each_sequence_decodes_at_its_own_pace():
    """The steady gaps of requests served one at a time spread as the pace knots say (each a
    golden-ratio quantile, so eight requests cover the distribution), with mean 1 times the
    step's cost; a batch of decodes takes its sequences' mean pace."""
    from kvmesh.sim.cluster import pace_quantile

    knots = (0.5, 0.6, 1.0, 1.4, 1.5)
    cost = fixed_steps(mesh=MeshOverheads(jitter=Jitter(pace=tuple(knots))))
    topology = Topology("disagg", 1, 1, kv_capacity_tokens=100_000)
    apart = [SimRequest(10.0 * i, 16, 40) for i in range(8)]
    records = simulate(topology, cost, apart, wake=False).records
    steady = [statistics.median(_gaps(r)[5:]) for r in records]
    for i, gap in enumerate(steady):
        assert gap == pytest.approx(0.01 * cost.pace(pace_quantile(i)))
    assert min(steady) < 0.0075 and max(steady) > 0.0125
    assert statistics.mean(steady) == pytest.approx(0.01, rel=0.1)
    # all at once: one batch, every step at the mean of the eight paces
    together = simulate(topology, cost, [SimRequest(0.0, 16, 40) for _ in range(8)]).records
    batch_gap = statistics.median(_gaps(together[0])[5:])
    assert batch_gap == pytest.approx(
        0.01 * statistics.mean(cost.pace(pace_quantile(i)) for i in range(8))
    )
    # a spec without a spread: every sequence at pace 1
    flat = simulate(topology, fixed_steps(), apart, wake=False).records
    assert {round(statistics.median(_gaps(r)[5:]), 9) for r in flat} == {0.01}


def _cpu(**overheads: float) -> CostModel:
    return CostModel(TINY, cpu_like(**overheads))


def _topology(mode: str, cost: CostModel) -> Topology:
    return mesh_topology(mode, cost)


def test_fit_overheads_recovers_the_overheads_a_probe_was_simulated_with():
    jitter = Jitter(0.0005, 0.003, 0.01)
    colocated_jitter = Jitter(0.001, 0.006, 0.02)
    truth = MeshOverheads(
        loop_s=0.0012,
        token_s=0.0003,
        colocated_loop_s=0.0015,
        colocated_token_s=0.0005,
        request_s=0.025,
        handoff_s=0.04,
        jitter=jitter,
        colocated_jitter=colocated_jitter,
    )
    probed = CostModel(TINY, truth.apply(_cpu().device))
    measured = {m: simulate_probe(probed, m, _topology) for m in ("colocated", "disagg")}
    jitters = {"colocated": colocated_jitter, "disagg": jitter}
    fit = fit_overheads(_cpu(), measured, _topology, jitters)
    got = fit.overheads
    assert got.jitter == jitter and got.colocated_jitter == colocated_jitter
    assert got.request_s == pytest.approx(truth.request_s, rel=0.05)
    assert got.handoff_s == pytest.approx(truth.handoff_s, rel=0.05)
    assert got.loop_s == pytest.approx(truth.loop_s, rel=0.1)
    assert got.token_s == pytest.approx(truth.token_s, rel=0.1)
    assert got.colocated_loop_s == pytest.approx(truth.colocated_loop_s, rel=0.1)
    assert got.colocated_token_s == pytest.approx(truth.colocated_token_s, rel=0.1)
    assert fit.max_relative_error < 0.02
    assert len(fit.residuals) == 6


def test_fit_overheads_clamps_a_negative_term_to_zero_with_a_note():
    # the mesh answered faster than the engine alone predicts: no negative request cost
    engine = _cpu()
    measured = simulate_probe(engine, "colocated", _topology)
    faster = ProbeFigures(measured.ttft_s / 2, measured.gap_1_s, measured.gap_batch_s)
    fit = fit_overheads(engine, {"colocated": faster}, _topology)
    assert fit.overheads.request_s == 0.0
    assert any("request_s" in note for note in fit.notes)
    # no disagg probe: the decode worker's loop terms are the colocated worker's
    assert fit.overheads.loop_s == fit.overheads.colocated_loop_s
    assert fit.overheads.token_s == fit.overheads.colocated_token_s


def test_mode_jitters_fall_back_to_the_other_mode():
    from kvmesh.sim.probe_figures import mode_jitters

    a, b = Jitter(0.001, 0.002, 0.003), Jitter(0.004, 0.005, 0.006)
    assert mode_jitters({"colocated": a, "disagg": b}) == (a, b)
    assert mode_jitters({"colocated": a}) == (a, a)
    assert mode_jitters({"disagg": b}) == (b, b)
    assert mode_jitters({}) == (Jitter(), Jitter())


def test_fit_overheads_needs_the_colocated_probe():
    engine = _cpu()
    with pytest.raises(OverheadFitError, match="colocated"):
        fit_overheads(engine, {"disagg": simulate_probe(engine, "disagg", _topology)}, _topology)


def test_probe_figures_median_takes_each_figure_median_over_runs():
    runs = [
        ProbeFigures(0.020, 0.0030, 0.0060),
        ProbeFigures(0.022, 0.0034, 0.0055),
        ProbeFigures(0.090, 0.0031, 0.0200),  # a disturbed run
    ]
    assert ProbeFigures.median(runs) == ProbeFigures(0.022, 0.0031, 0.0060)
    assert ProbeFigures.median(runs[:2]) == ProbeFigures(
        pytest.approx(0.021), pytest.approx(0.0032), pytest.approx(0.00575)
    )
    assert ProbeFigures.median(runs[:1]) == runs[0]
    with pytest.raises(OverheadFitError):
        ProbeFigures.median([])


def _constant_gaps(index: int, gap: float, n: int = 40) -> RequestRecord:
    times = tuple(0.02 + gap * i for i in range(n))
    return RequestRecord(index, 0.0, 0.0, times[-1], 64, n, n, times)


def test_pooled_jitter_is_of_every_runs_gaps_together():
    """A validation pools its repeats' gaps: a run slower throughout than another widens the
    spread it measures, and so does it the pooled probe's request-to-request pace (not its
    step-to-step jitter: each request's gaps are constant)."""
    from kvmesh.sim.probe_fit import pool_probe_runs

    def run(gap: float) -> dict[str, ProbeRecords]:
        isolated = tuple(_constant_gaps(i, gap) for i in range(4))
        return {"colocated": ProbeRecords("colocated", isolated, isolated)}

    # every gap of run 1 is 3 ms and of run 2 is 4 ms: neither varies alone; together half
    # the requests are slower than the other half, none varies step to step
    pooled = pool_probe_runs([run(0.003), run(0.004)])
    alone = pool_probe_runs([run(0.003)]).jitter["colocated"]
    assert alone.max_s == pytest.approx(0.0, abs=1e-12)
    assert alone.pace == pytest.approx((1.0,) * 5)
    union = [*run(0.003)["colocated"].isolated, *run(0.004)["colocated"].isolated]
    assert pooled.jitter == {"colocated": jitter_of(union)}
    jitter = pooled.jitter["colocated"]
    assert jitter.max_s == pytest.approx(0.0, abs=1e-12)
    # knots 3, 3, 3.5, 4, 4 ms; their piecewise-linear mean 3.5 ms
    assert jitter.pace == pytest.approx((3 / 3.5, 3 / 3.5, 1.0, 4 / 3.5, 4 / 3.5))
    assert pooled.figures["colocated"].gap_1_s == pytest.approx(0.0035)


def test_pool_probe_runs_of_one_run_is_that_runs_figures():
    from kvmesh.sim.probe_fit import pool_probe_runs

    jitters = {
        "jitter": Jitter(0.001, 0.002, 0.004),
        "colocated_jitter": Jitter(0.002, 0.004, 0.008),
    }
    cost = _cpu(mesh=MeshOverheads(request_s=0.01, **jitters))
    run = {m: simulated_probe(m, cost) for m in ("colocated", "disagg")}
    pooled = pool_probe_runs([run])
    for m in ("colocated", "disagg"):
        assert pooled.figures[m] == ProbeFigures.of(run[m].isolated, run[m].batch)
        assert pooled.timings[m].short == run[m].short_timings
        assert pooled.long[m] == run[m].long
    # each mode's jitter from its own gaps
    assert pooled.jitter == {m: jitter_of(run[m].isolated) for m in ("colocated", "disagg")}
    assert pooled.jitter["colocated"] != pooled.jitter["disagg"]


@pytest.mark.slow  # seconds: left out of make test-fast
def test_fit_to_the_runs_medians_ignores_one_disturbed_run():
    from kvmesh.sim.probe_fit import fit_probe, pool_probe_runs

    # the disturbed run's request path and hand-off are slow, its gaps as the others' (slower
    # gaps would widen the pooled jitter, as test_pooled_jitter_is_of_every_runs_gaps_together)
    quiet = _cpu(mesh=MeshOverheads(request_s=0.02, handoff_s=0.01, loop_s=0.001))
    busy = _cpu(mesh=MeshOverheads(request_s=0.2, handoff_s=0.05, loop_s=0.001))
    a = {m: simulated_probe(m, quiet) for m in ("colocated", "disagg")}
    b = {m: simulated_probe(m, busy) for m in ("colocated", "disagg")}
    pooled = pool_probe_runs([a, b, a])
    assert pooled.figures == pool_probe_runs([a]).figures
    # the long prompts' check is over every run's records
    assert len(pooled.long["colocated"]) == 3 * len(a["colocated"].long)
    engine = _cpu().device
    fit, scaled = fit_probe(engine, TINY, pooled)
    alone, alone_scaled = fit_probe(engine, TINY, pool_probe_runs([a]))
    # the same figures (the median phase means' counts are three runs', hence approx)
    for name in ("loop_s", "token_s", "colocated_loop_s", "colocated_token_s", "request_s"):
        assert getattr(fit.overheads, name) == pytest.approx(getattr(alone.overheads, name)), name
    assert fit.overheads.handoff_s == pytest.approx(alone.overheads.handoff_s)
    for which in ("jitter", "colocated_jitter"):  # the same gaps: equal to rounding
        got, want = getattr(fit.overheads, which), getattr(alone.overheads, which)
        assert (got.p90_s, got.p99_s, got.max_s) == pytest.approx(
            (want.p90_s, want.p99_s, want.max_s), abs=1e-9
        )
        assert got.pace == pytest.approx(want.pace, abs=1e-9)
    assert scaled is not None and alone_scaled is not None
    for term in ("colocated", "colocated_extra_s", "decode", "prefill"):
        assert getattr(scaled.scale, term) == pytest.approx(
            getattr(alone_scaled.scale, term), abs=1e-9
        )
    assert fit.overheads.request_s == pytest.approx(0.02, rel=0.1)
    # a mean of the three would not: the busy run alone fits a request ten times as long
    busy_fit, _ = fit_probe(engine, TINY, pool_probe_runs([b]), checks=False)
    assert busy_fit.overheads.request_s > 0.1
    assert busy_fit.checks == ()


def test_a_worker_that_idled_pays_its_wake_term_on_its_next_step():
    from kvmesh.sim.cost import WAKE_AFTER_S

    cost = fixed_steps(mesh=MeshOverheads(colocated_wake_s=0.05))
    topology = Topology("colocated", 1, kv_capacity_tokens=10_000)
    # three requests of 3 steps (30 ms each): the second sent as the first ends, the third after
    # the worker has idled longer than WAKE_AFTER_S
    requests = [
        SimRequest(0.0, 16, 3),
        SimRequest(0.08 + 1e-9, 16, 3),
        SimRequest(0.2 + WAKE_AFTER_S, 16, 3),
    ]
    woken = simulate(topology, cost, requests).records
    assert [r.ttft_s for r in woken] == pytest.approx([0.06, 0.01, 0.06])
    assert woken[0].itl_s == pytest.approx([0.01, 0.01])  # only the first step after idling
    asleep = simulate(topology, cost, requests, wake=False).records
    assert [r.ttft_s for r in asleep] == pytest.approx([0.01, 0.01, 0.01])
    # a decode worker has no wake term; a prefill worker has its own
    disagg = fixed_steps(mesh=MeshOverheads(colocated_wake_s=0.05, prefill_wake_s=0.02))
    one = [SimRequest(0.0, 16, 3)]
    plain = simulate(Topology("disagg", 1, 1, kv_capacity_tokens=10_000), fixed_steps(), one)
    with_wake = simulate(Topology("disagg", 1, 1, kv_capacity_tokens=10_000), disagg, one)
    assert with_wake.records[0].ttft_s == pytest.approx(plain.records[0].ttft_s + 0.02)
    assert with_wake.records[0].itl_s == pytest.approx(plain.records[0].itl_s)
    with pytest.raises(SpecError, match="prefill_wake_s"):
        fixed_steps(mesh=MeshOverheads(prefill_wake_s=-0.01))


def test_fit_wake_recovers_the_wake_terms_the_woken_probe_had():
    from kvmesh.sim.overheads import fit_wake
    from kvmesh.sim.probe import long_requests

    truth = _cpu(mesh=MeshOverheads(request_s=0.01, colocated_wake_s=0.03, prefill_wake_s=0.012))
    woken = {
        m: simulate(_topology(m, truth), truth, long_requests()).records
        for m in ("colocated", "disagg")
    }
    fitted, residuals = fit_wake(_cpu(mesh=MeshOverheads(request_s=0.01)), woken, _topology)
    assert fitted.colocated_wake_s == pytest.approx(0.03, rel=0.05)
    assert fitted.prefill_wake_s == pytest.approx(0.012, rel=0.1)
    assert [r.label for r in residuals] == [
        "colocated TTFT of a 1024-token prompt after idling",
        "disagg TTFT of a 1024-token prompt after idling",
    ]
    assert all(abs(r.relative) < 0.02 for r in residuals)
    # a mesh no slower after idling: no wake (never negative); no woken records: 0
    plain = _cpu(mesh=MeshOverheads(request_s=0.01))
    same = {"colocated": simulate(_topology("colocated", plain), plain, long_requests()).records}
    assert fit_wake(plain, same, _topology)[0].colocated_wake_s == pytest.approx(0.0, abs=1e-6)
    assert fit_wake(plain, {}, _topology)[0] == MeshOverheads()


@pytest.mark.slow  # seconds: left out of make test-fast
def test_fit_probe_fits_the_wake_to_the_woken_long_prompts():
    from kvmesh.sim.probe import long_requests
    from kvmesh.sim.probe_fit import fit_probe, pool_probe_runs

    truth = _cpu(mesh=MeshOverheads(request_s=0.02, colocated_wake_s=0.04, prefill_wake_s=0.01))
    run = {}
    for m in ("colocated", "disagg"):
        woken = simulate(_topology(m, truth), truth, long_requests()).records
        run[m] = dataclasses.replace(simulated_probe(m, truth), woken=woken)
    pooled = pool_probe_runs([run, run])
    assert len(pooled.woken["colocated"]) == 2 * len(long_requests())
    fit, _ = fit_probe(_cpu().device, TINY, pooled)
    assert fit.overheads.colocated_wake_s == pytest.approx(0.04, rel=0.15)
    assert fit.overheads.prefill_wake_s == pytest.approx(0.01, rel=0.3)
    assert any("after idling" in r.label for r in fit.residuals)
    # the back-to-back phases are simulated without it: their figures and check still match
    assert fit.max_check_error < 0.1


def test_a_sequences_first_decode_steps_pay_the_warm_up_tapering():
    from kvmesh.sim.cost import WARMUP_STEPS

    assert WARMUP_STEPS == 4
    one = [SimRequest(0.0, 16, 10)]
    for mode, field in (("colocated", "colocated_warmup_s"), ("disagg", "decode_warmup_s")):
        topology = Topology(mode, 1, 1 if mode == "disagg" else 0, kv_capacity_tokens=10_000)
        plain = simulate(topology, fixed_steps(), one).records[0]
        warm = simulate(topology, fixed_steps(mesh=MeshOverheads(**{field: 0.004})), one).records[0]
        extra = [w - p for w, p in zip(warm.itl_s, plain.itl_s, strict=True)]
        assert extra == pytest.approx([0.004, 0.003, 0.002, 0.001, 0, 0, 0, 0, 0], abs=1e-9)
        assert warm.ttft_s == pytest.approx(plain.ttft_s)  # the first token does not pay it
    # a batch's step pays it for each sequence in its first steps; a prefill worker never
    cost = fixed_steps(mesh=MeshOverheads(decode_warmup_s=0.004, colocated_warmup_s=0.002))
    assert cost.warmup_s("decode", 0) == pytest.approx(0.004)
    assert cost.warmup_s("colocated", 2) == pytest.approx(0.001)
    assert cost.warmup_s("decode", 4) == cost.warmup_s("prefill", 0) == 0.0
    with pytest.raises(SpecError, match="decode_warmup_s"):
        fixed_steps(mesh=MeshOverheads(decode_warmup_s=-0.001))


def _record(gaps: list[float]) -> RequestRecord:
    times = [0.1]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(0, 0.0, 0.0, times[-1], 1024, len(times), len(times), tuple(times))


def test_warmup_is_the_first_gaps_excess_over_the_steady_gap_fitted_to_the_taper():
    from kvmesh.sim.overheads import fit_warmup, warmup_of

    steady = [0.002] * 11
    tapered = [0.002 + 0.0008 * w for w in (1.0, 0.75, 0.5, 0.25)]
    records = [_record(tapered + steady), _record(tapered + steady), _record([0.002] * 15)]
    assert warmup_of(records) == pytest.approx(0.0008)  # the median request's excess
    assert warmup_of(records[2:]) == pytest.approx(0.0)
    # faster first gaps are no negative term; streams too short to tell give 0
    assert warmup_of([_record([0.001] * 4 + steady)]) == 0.0
    assert warmup_of([_record(tapered + [0.002] * 3)]) == 0.0
    fitted = fit_warmup({"colocated": records[:1], "disagg": records[2:]})
    assert fitted == MeshOverheads(colocated_warmup_s=pytest.approx(0.0008))


@pytest.mark.slow  # seconds: left out of make test-fast
def test_fit_probe_measures_the_warm_up_on_the_long_prompts():
    from kvmesh.sim.probe_fit import fit_probe, pool_probe_runs

    truth = _cpu(
        mesh=MeshOverheads(request_s=0.02, decode_warmup_s=0.0006, colocated_warmup_s=0.001)
    )
    run = {m: simulated_probe(m, truth) for m in ("colocated", "disagg")}
    fit, _ = fit_probe(_cpu().device, TINY, pool_probe_runs([run]))
    assert fit.overheads.decode_warmup_s == pytest.approx(0.0006, rel=0.15)
    assert fit.overheads.colocated_warmup_s == pytest.approx(0.001, rel=0.15)
    assert fit.overheads.apply(_cpu().device).mesh.decode_warmup_s == fit.overheads.decode_warmup_s
