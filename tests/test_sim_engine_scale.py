"""The engine's slowdown inside the mesh's workers (per role) in the simulator, and its fit to
the probe's engine means."""

from __future__ import annotations

import dataclasses

import pytest
from kvmesh.loadgen.sim.cluster import simulate
from kvmesh.loadgen.sim.cost import CostModel, Slice
from kvmesh.loadgen.sim.engine_scale import (
    EngineScale,
    fit_engine_scale,
    simulate_probe_timings,
)
from kvmesh.loadgen.sim.engine_timings import EngineTimings, pooled
from kvmesh.loadgen.sim.specs import DeviceSpec, SpecError, load_device, load_model, write_device
from kvmesh.loadgen.sim.topology import Topology
from kvmesh.loadgen.sim.validate import mesh_topology
from kvmesh.loadgen.sim.workload import SimRequest

TINY = load_model("kvmesh-tiny")


def _fixed(**fields: float) -> CostModel:
    """Steps that cost 10 ms of fixed overhead only (no compute, no memory, an instant link)."""
    return CostModel(
        TINY, DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=0.01, **fields)
    )


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


def test_step_with_role_costs_engine_times_that_roles_scale():
    cost = _fixed(
        colocated_engine_scale=1.5,
        decode_engine_scale=2.0,
        prefill_engine_scale=3.0,
        loop_overhead_s=0.002,
    )
    slices = [Slice(1, 100)]
    assert cost.step(slices).seconds == pytest.approx(0.010)
    assert cost.step(slices, "colocated").seconds == pytest.approx(0.015)
    assert cost.step(slices, "decode").seconds == pytest.approx(0.020)
    assert cost.step([Slice(512, 0)], "prefill").seconds == pytest.approx(0.030)
    # the loop's own cost is not the engine's: it is not scaled
    assert cost.loop_step(slices, num_tokens=0).seconds == pytest.approx(0.020 + 0.002)


def test_simulated_engine_means_scale_by_role_on_dedicated_devices():
    cost = _fixed(decode_engine_scale=2.0, prefill_engine_scale=3.0, colocated_engine_scale=1.5)
    requests = [SimRequest(0.0, 100, 5)]
    disagg = simulate(_dedicated("disagg", cost), cost, requests).timings
    assert disagg.prefill_chunk_s == pytest.approx(0.030)
    assert disagg.home_step_s == pytest.approx(0.020)
    colocated = simulate(_dedicated("colocated", cost), cost, requests).timings
    assert colocated.home_step_s == pytest.approx(0.015)


def test_fit_engine_scale_is_mesh_mean_over_model_mean_per_role():
    # every simulated step costs 10 ms unscaled: the scales are the measured means / 10 ms
    measured = {"colocated": _timings(0.025), "disagg": _timings(0.020, chunk_s=0.040)}
    fit = fit_engine_scale(
        _fixed(), measured, lambda m, c: simulate_probe_timings(m, c, _dedicated)
    )
    assert fit.scale.colocated == pytest.approx(2.5)
    assert fit.scale.decode == pytest.approx(2.0)
    assert fit.scale.prefill == pytest.approx(4.0)
    by_role = {f.role: f for f in fit.figures}
    assert by_role["prefill"].unscaled_s == pytest.approx(0.010)
    assert by_role["prefill"].scaled_s == pytest.approx(0.040)
    assert by_role["colocated"].count == 100
    assert "colocated x2.50" in fit.describe()


def test_fit_engine_scale_keeps_roles_the_probe_did_not_measure_at_one():
    fit = fit_engine_scale(
        _fixed(),
        {"colocated": _timings(0.030)},
        lambda m, c: simulate_probe_timings(m, c, _dedicated),
    )
    assert fit.scale == EngineScale(colocated=pytest.approx(3.0), decode=1.0, prefill=1.0)
    assert [f.role for f in fit.figures] == ["colocated"]


def test_fit_engine_scale_matches_means_on_shared_cores():
    # the mesh twin: workers share 2 cores, so a role's mean is not proportional to its scale;
    # the iterated fit still reproduces the measured means
    device = DeviceSpec(
        "cpu2", 20e9, 5e9, 16e9, 2e9, step_overhead_s=0.001, cores=2, calibration_threads=2
    )
    cost = CostModel(TINY, device)
    sim = lambda m, c: simulate_probe_timings(m, c, mesh_topology)
    unscaled = {m: sim(m, cost) for m in ("colocated", "disagg")}
    measured = {
        "colocated": _timings(unscaled["colocated"].home_step_s * 2.0),
        "disagg": _timings(
            unscaled["disagg"].home_step_s * 2.0, chunk_s=unscaled["disagg"].prefill_chunk_s * 1.5
        ),
    }
    fit = fit_engine_scale(cost, measured, sim)
    assert {f.role for f in fit.figures} == {"colocated", "decode", "prefill"}
    for f in fit.figures:
        assert abs(f.relative) < 0.02, f
    assert fit.scale.colocated > 1.5 and fit.scale.decode > 1.5 and fit.scale.prefill > 1.2


def test_pooled_timings_weight_means_by_count():
    a = EngineTimings(3, 0.010, 1, 0.100, 1, 0.0)
    b = EngineTimings(1, 0.030, 0, None, 0, None)
    p = pooled([a, b])
    assert (p.home_steps, p.prefill_chunks, p.prefill_jobs) == (4, 1, 1)
    assert p.home_step_s == pytest.approx((3 * 0.010 + 0.030) / 4)
    assert p.prefill_chunk_s == pytest.approx(0.100)


def test_engine_scale_round_trips_through_spec_file(tmp_path):
    spec = EngineScale(1.8, 2.1, 1.4).apply(_fixed().device)
    loaded = load_device(write_device(spec, tmp_path / "cpu.json"))
    assert loaded.engine_scale("colocated") == 1.8
    assert loaded.engine_scale("decode") == 2.1
    assert loaded.engine_scale("prefill") == 1.4


def test_engine_scale_of_zero_is_refused():
    with pytest.raises(SpecError):
        dataclasses.replace(_fixed().device, decode_engine_scale=0.0)
