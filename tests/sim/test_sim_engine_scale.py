"""The engine's slowdown inside the mesh's workers (per role) in the simulator, and its fit to
the probe's engine means."""

from __future__ import annotations

import dataclasses

import pytest
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel, Slice
from kvmesh.sim.engine_scale import (
    EngineScale,
    PhaseTimings,
    fit_engine_scale,
    simulate_probe_timings,
)
from kvmesh.sim.engine_timings import EngineTimings, pooled
from kvmesh.sim.mesh_terms import MeshOverheads
from kvmesh.sim.specs import DeviceSpec, SpecError, load_device, load_model, write_device
from kvmesh.sim.topology import Topology
from kvmesh.sim.validate import mesh_topology
from kvmesh.sim.workload import SimRequest
from support.sim_probe_fakes import fixed_steps

TINY = load_model("kvmesh-tiny")


def _dedicated(mode: str, cost: CostModel) -> Topology:
    """One worker per role, each on a device of its own: steps take exactly their cost."""
    return Topology(
        mode,  # type: ignore[arg-type]
        num_decode=1,
        num_prefill=1 if mode == "disagg" else 0,
        chunk_tokens=512,
        kv_capacity_tokens=100_000,
    )


def _timings(step_s: float | None, chunk_s: float | None = None) -> EngineTimings:
    return EngineTimings(100, step_s, 10 if chunk_s else 0, chunk_s, 0, None)


def _phases(short: EngineTimings, long: EngineTimings | None = None) -> PhaseTimings:
    return PhaseTimings(short, long or EngineTimings(0, None, 0, None, 0, None))


def _scaled_by_role(colocated_extra_s: float, **fields: float) -> CostModel:
    """Fixed 10 ms steps, the engine 1.5 times slower colocated (and ``colocated_extra_s`` on
    top), 2 times on decode, 3 times on prefill; ``fields`` on top."""
    scale = EngineScale(colocated=1.5, decode=2.0, prefill=3.0, colocated_extra_s=colocated_extra_s)
    return fixed_steps(engine=scale, **fields)


def test_step_with_role_costs_engine_times_that_roles_scale():
    cost = _scaled_by_role(0.003, mesh=MeshOverheads(loop_s=0.002))
    slices = [Slice(1, 100)]
    assert cost.step(slices).seconds == pytest.approx(0.010)
    # a colocated step: its engine times the scale, and the stall on top, whatever it computes
    assert cost.step(slices, "colocated").seconds == pytest.approx(0.018)
    assert cost.step([Slice(1, 100), Slice(64, 0)], "colocated").seconds == pytest.approx(0.018)
    assert cost.step(slices, "colocated").overhead_s == pytest.approx(0.018)
    assert cost.step(slices, "decode").seconds == pytest.approx(0.020)
    assert cost.step([Slice(512, 0)], "prefill").seconds == pytest.approx(0.030)
    # the loop's own cost is not the engine's: it is not scaled
    assert cost.loop_step(slices, num_tokens=0).seconds == pytest.approx(0.020 + 0.002)


def test_simulated_engine_means_scale_by_role_on_dedicated_devices():
    cost = _scaled_by_role(0.001)
    requests = [SimRequest(0.0, 100, 5)]
    disagg = simulate(_dedicated("disagg", cost), cost, requests).timings
    assert disagg.prefill_chunk_s == pytest.approx(0.030)
    assert disagg.home_step_s == pytest.approx(0.020)
    colocated = simulate(_dedicated("colocated", cost), cost, requests).timings
    assert colocated.home_step_s == pytest.approx(0.016)


def _chunky(**fields: float) -> CostModel:
    """A decode step costs 10 ms, a step with a prefill chunk 60 ms (fixed overheads only)."""
    return fixed_steps(chunk_overhead_s=0.05, **fields)


def _probe_means(cost: CostModel, modes=("colocated", "disagg")) -> dict[str, PhaseTimings]:
    return {m: simulate_probe_timings(m, cost, _dedicated) for m in modes}


@pytest.mark.slow  # seconds: left out of make test-fast
def test_fit_engine_scale_recovers_the_scales_and_colocated_stall_a_probe_had():
    truth = EngineScale(colocated=1.5, decode=2.0, prefill=4.0, colocated_extra_s=0.008)
    measured = _probe_means(CostModel(TINY, truth.apply(_chunky().device)))
    fit = fit_engine_scale(
        _chunky(), measured, lambda m, c: simulate_probe_timings(m, c, _dedicated)
    )
    assert fit.scale.colocated == pytest.approx(1.5, rel=1e-3)
    assert fit.scale.colocated_extra_s == pytest.approx(0.008, rel=1e-2)
    # every decode step costs 10 ms here: its two figures cannot tell a stall from a factor
    assert fit.scale.decode == pytest.approx(2.0, rel=1e-3)
    assert fit.scale.prefill == pytest.approx(4.0)
    by_role = {f.role: f for f in fit.figures}
    assert set(by_role) == {"colocated", "colocated_chunk", "decode", "decode_long", "prefill"}
    for f in fit.figures:
        assert abs(f.relative) < 1e-3, f
    assert by_role["decode"].unscaled_s == pytest.approx(0.010)
    assert "decode x2.00" in fit.describe()
    assert "colocated x1.50 + 8.00 ms" in fit.describe()


def test_fit_engine_scale_wants_no_negative_stall():
    # chunks slowed 3x, decode steps 1.2x: a factor and a stall through both would need a
    # negative stall; the stall is 0 and the factor lies between
    base = _probe_means(_chunky(), ("colocated",))["colocated"]
    measured = {
        "colocated": _phases(
            dataclasses.replace(base.short, home_step_s=base.short.home_step_s * 1.2),
            dataclasses.replace(base.long, home_step_s=base.long.home_step_s * 3.0),
        )
    }
    fit = fit_engine_scale(
        _chunky(), measured, lambda m, c: simulate_probe_timings(m, c, _dedicated)
    )
    assert fit.scale.colocated_extra_s == 0.0
    assert 1.2 < fit.scale.colocated < 3.0


def test_fit_engine_scale_keeps_roles_the_probe_did_not_measure_at_one():
    fit = fit_engine_scale(
        fixed_steps(),
        {"colocated": _phases(_timings(0.030))},
        lambda m, c: simulate_probe_timings(m, c, _dedicated),
    )
    # 30 ms a step where every step costs 10 ms; no long phase: a factor alone, no stall
    assert fit.scale == EngineScale(
        colocated=pytest.approx(3.0), decode=1.0, prefill=1.0, colocated_extra_s=0.0
    )
    assert [f.role for f in fit.figures] == ["colocated"]


@pytest.mark.slow  # seconds: left out of make test-fast
def test_fit_engine_scale_matches_means_on_shared_cores():
    # the mesh twin: workers share 2 cores, so a role's mean is not proportional to its scale;
    # the iterated fit still reproduces the measured means
    device = DeviceSpec(
        "cpu2", 20e9, 5e9, 16e9, 2e9, step_overhead_s=0.001, cores=2, calibration_threads=2
    )
    cost = CostModel(TINY, device)
    sim = lambda m, c: simulate_probe_timings(m, c, mesh_topology)
    unscaled = {m: sim(m, cost) for m in ("colocated", "disagg")}
    co, dis = unscaled["colocated"], unscaled["disagg"]
    measured = {
        "colocated": _phases(
            dataclasses.replace(co.short, home_step_s=co.short.home_step_s * 2.0),
            dataclasses.replace(co.long, home_step_s=co.long.home_step_s * 1.4),
        ),
        "disagg": _phases(
            dataclasses.replace(
                dis.short,
                home_step_s=dis.short.home_step_s * 2.0,
                prefill_chunk_s=dis.short.prefill_chunk_s * 1.5,
            ),
            dataclasses.replace(
                dis.long,
                home_step_s=dis.long.home_step_s * 1.9,
                prefill_chunk_s=dis.long.prefill_chunk_s * 1.5,
            ),
        ),
    }
    fit = fit_engine_scale(cost, measured, sim)
    assert {f.role for f in fit.figures} == {
        "colocated",
        "colocated_chunk",
        "decode",
        "decode_long",
        "prefill",
    }
    for f in fit.figures:
        assert abs(f.relative) < 0.02, f
    assert fit.scale.prefill > 1.2
    # decode steps at short contexts slowed more than at long ones: a stall beside a factor
    assert fit.scale.decode_extra_s > 0 and 0.5 < fit.scale.decode < 2.0
    # decode steps slowed more than chunks: a stall per step beside a factor
    assert fit.scale.colocated_extra_s > 0 and 1.0 < fit.scale.colocated < 2.0


def test_pooled_timings_weight_means_by_count():
    a = EngineTimings(3, 0.010, 1, 0.100, 1, 0.0)
    b = EngineTimings(1, 0.030, 0, None, 0, None)
    p = pooled([a, b])
    assert (p.home_steps, p.prefill_chunks, p.prefill_jobs) == (4, 1, 1)
    assert p.home_step_s == pytest.approx((3 * 0.010 + 0.030) / 4)
    assert p.prefill_chunk_s == pytest.approx(0.100)


def test_engine_scale_round_trips_through_spec_file(tmp_path):
    spec = EngineScale(1.8, 2.1, 1.4, 0.003).apply(fixed_steps().device)
    loaded = load_device(write_device(spec, tmp_path / "cpu.json"))
    assert loaded.engine_extra_s("colocated") == 0.003
    assert loaded.engine_extra_s("decode") == loaded.engine_extra_s("prefill") == 0.0
    assert loaded.engine_scale("colocated") == 1.8
    assert loaded.engine_scale("decode") == 2.1
    assert loaded.engine_scale("prefill") == 1.4


def test_engine_scale_of_zero_is_refused():
    with pytest.raises(SpecError):
        EngineScale(decode=0.0).apply(fixed_steps().device)
    with pytest.raises(SpecError):
        EngineScale(colocated_extra_s=-0.001).apply(fixed_steps().device)


def test_fit_engine_scale_takes_jitter_mean_off_loop_steps_not_chunks():
    # a mesh step of 25 ms holds 5 ms of jitter on average, which the simulator adds apart: the
    # engine's share is 20 ms, scale 2; a prefill chunk is no loop step and keeps its 40 ms
    measured = {"disagg": _phases(_timings(0.025, chunk_s=0.040))}
    fit = fit_engine_scale(
        fixed_steps(),
        measured,
        lambda m, c: simulate_probe_timings(m, c, _dedicated),
        jitter_mean_s={"decode": 0.005, "colocated": 0.5},
    )
    assert fit.scale.decode == pytest.approx(2.0)
    assert fit.scale.prefill == pytest.approx(4.0)


def test_jitter_mean_integrates_its_quantile_function():
    from kvmesh.sim.probe_figures import Jitter

    # 0 to the median; 0->2 ms over 0.5-0.9; 2->6 ms over 0.9-0.99; 6->10 ms over 0.99-1
    j = Jitter(0.002, 0.006, 0.010)
    assert j.mean_s == pytest.approx(0.4 * 0.001 + 0.09 * 0.004 + 0.01 * 0.008)


def test_median_timings_take_each_mean_median_over_runs_and_add_counts():
    from kvmesh.sim.engine_scale import median_timings

    runs = [
        EngineTimings(100, 0.010, 4, 0.050, 2, 0.001),
        EngineTimings(120, 0.012, 4, 0.060, 2, 0.002),
        EngineTimings(90, 0.040, 5, 0.200, 2, 0.009),  # a disturbed run: it moves no median
    ]
    m = median_timings(runs)
    assert (m.home_steps, m.prefill_chunks, m.prefill_jobs) == (310, 13, 6)
    assert m.home_step_s == pytest.approx(0.012)
    assert m.prefill_chunk_s == pytest.approx(0.060)
    assert m.prefill_queue_s == pytest.approx(0.002)
    # a pooled (count-weighted) mean would be pulled up by the disturbed run
    assert pooled(runs).home_step_s > 0.017
    # a run that did not measure a mean (count 0) neither votes nor counts
    none = EngineTimings(0, None, 0, None, 0, None)
    two = median_timings([runs[0], none, runs[1]])
    assert two.home_steps == 220 and two.home_step_s == pytest.approx(0.011)
    assert median_timings([none]).home_step_s is None


def test_median_phases_is_one_runs_timings_for_one_run():
    from kvmesh.sim.engine_scale import median_phases

    one = _phases(_timings(0.020, chunk_s=0.040), _timings(0.030, chunk_s=0.050))
    assert median_phases([one]) == one
    slow = _phases(_timings(0.060, chunk_s=0.090), _timings(0.090, chunk_s=0.150))
    med = median_phases([one, one, slow])
    assert med.short.home_step_s == pytest.approx(0.020)
    assert med.long.prefill_chunk_s == pytest.approx(0.050)
    assert med.short.home_steps == 300
    with pytest.raises(ValueError):
        median_phases([])
