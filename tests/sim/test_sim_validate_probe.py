"""kvmesh sim --validate --probe-each-run: every validation mesh probed before and after its
workload; the simulation fitted to the median of all those probe runs (``pooled``), or each
repeat to its own and each real run compared with its own simulation (``each``). No real mesh:
``run_real`` is replaced by canned runs whose records and probes the simulator made with known
overheads."""

from __future__ import annotations

import dataclasses
import json

import pytest
from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim import validate
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.mesh_terms import Jitter, MeshOverheads
from kvmesh.sim.specs import DeviceSpec, EngineScale, load_model
from kvmesh.sim.validate import (
    RealRun,
    SetAside,
    Steal,
    comparison_each,
    engine_only,
    format_comparisons,
    format_runs,
    mesh_topology,
    pooled_summary,
    records_json,
)
from kvmesh.sim.workload import SimRequest
from support.sim_probe_fakes import cpu_like, simulated_probe

TINY = load_model("kvmesh-tiny")
MODES = ("colocated", "disagg")
REQUESTS = [SimRequest(i * 2.0, 100 + 50 * i, 8) for i in range(4)]


def _engine() -> DeviceSpec:
    """A CPU-like engine (the figures ``--calibrate`` measures), no mesh terms."""
    return cpu_like()


def _mesh(request_s: float) -> CostModel:
    """The 'real' mesh of one repeat: the engine plus a request overhead of ``request_s``."""
    return CostModel(TINY, dataclasses.replace(_engine(), mesh=MeshOverheads(request_s=request_s)))


def _real_run(mode: str, cost: CostModel) -> RealRun:
    """A real run of ``REQUESTS`` on a mesh that behaves as ``cost``, probed before and after."""
    sim = simulate(mesh_topology(mode, cost), cost, REQUESTS)
    probe = simulated_probe(mode, cost)
    return RealRun(list(sim.records), sim.summary.duration_s, sim.timings, (probe, probe))


def _config() -> ServeBenchConfig:
    return ServeBenchConfig(model="kvmesh-tiny", num_prompts=len(REQUESTS), compare=MODES)


def test_engine_only_drops_the_specs_scales_and_overheads():
    spec = dataclasses.replace(
        _engine(),
        engine=EngineScale(colocated=3.0, prefill=2.0),
        mesh=MeshOverheads(request_s=1.0, loop_s=0.01, jitter=Jitter(0.0, 0.02, 0.03)),
    )
    assert engine_only(spec) == _engine()


@pytest.mark.slow  # seconds: left out of make test-fast
def test_each_repeat_is_simulated_with_the_fit_to_its_own_probe(monkeypatch):
    # the machine drifts: the first repeat's mesh takes 10 ms a request, the second's 80 ms
    meshes = [_mesh(0.010), _mesh(0.080)]
    served: list[tuple[str, bool]] = []

    def run_real(config: ServeBenchConfig, mode: str, probe: bool = False) -> RealRun:
        served.append((mode, probe))
        return _real_run(mode, meshes[(len(served) - 1) // len(MODES)])

    monkeypatch.setattr(validate, "run_real", run_real)
    # the spec's own scale and overheads (a stale calibration) must not be used
    stale = dataclasses.replace(
        _engine(), engine=EngineScale(3.0), mesh=MeshOverheads(request_s=0.5)
    )
    runs = validate.serve(_config(), MODES, repeats=2, probe=True).runs
    comparisons = validate.compare_served(runs, CostModel(TINY, stale), REQUESTS, fit="each")
    assert served == [("colocated", True), ("disagg", True)] * 2  # the modes in turn, probed
    for c in comparisons:
        assert len(c.fits) == 2 and len(c.sim_runs) == 2 and c.sim_once is None
        fitted = [f.cost.device.mesh.request_s for f in c.fits]
        assert fitted == [pytest.approx(0.010, rel=0.2), pytest.approx(0.080, rel=0.1)]
        for f in c.fits:
            assert f.engine_scale is not None
            assert f.cost.device.engine.colocated == pytest.approx(1.0, rel=0.1)
            assert f.mesh.checks  # the long prompts' TTFT checked on each repeat's fit
        # each run against its own simulation: the fitted mesh reproduces it
        for values in c.run_ratios():
            assert values["TTFT p50"] == pytest.approx(1.0, rel=0.1)
            assert values["ITL p50"] == pytest.approx(1.0, rel=0.1)
        # the two simulations differ as their meshes did, and the pooled sim is both of them
        first, second = (sim.summary.ttft.p50_ms for sim in c.sim_runs)
        assert second - first == pytest.approx(70.0, rel=0.2)
        assert c.sim == pooled_summary([(s.records, s.summary.duration_s) for s in c.sim_runs])
        assert c.sim_records == (*c.sim_runs[0].records, *c.sim_runs[1].records)
        assert c.ratios()["TTFT p50"] == pytest.approx(1.0, rel=0.15)
        assert c.sim_of(1) == c.sim_runs[1].records


@pytest.mark.slow  # seconds: left out of make test-fast
def test_the_pooled_fit_is_to_the_median_of_every_probe_run(monkeypatch):
    # three repeats, the last one's meshes disturbed: 10, 10 and 80 ms a request
    meshes = [_mesh(0.010), _mesh(0.010), _mesh(0.080)]
    served: list[tuple[str, bool]] = []

    def run_real(config: ServeBenchConfig, mode: str, probe: bool = False) -> RealRun:
        served.append((mode, probe))
        return _real_run(mode, meshes[(len(served) - 1) // len(MODES)])

    monkeypatch.setattr(validate, "run_real", run_real)
    runs = validate.serve(_config(), MODES, repeats=3, probe=True).runs
    assert served == [("colocated", True), ("disagg", True)] * 3
    assert len(validate.probe_runs(runs)) == 6  # two a mesh
    assert len(validate.probe_runs(runs, 2)) == 2
    stale = dataclasses.replace(_engine(), mesh=MeshOverheads(request_s=0.5))
    comparisons = validate.compare_served(runs, CostModel(TINY, stale), REQUESTS, fit="pooled")
    for c in comparisons:
        (fit,) = c.fits
        # the median of six probe runs, four of them undisturbed: not the mean (~33 ms)
        assert fit.cost.device.mesh.request_s == pytest.approx(0.010, rel=0.2)
        assert c.sim_runs == () and c.sim_once is not None
        assert (
            c.sim_records == simulate(mesh_topology(c.mode, fit.cost), fit.cost, REQUESTS).records
        )
    assert "the simulation fitted to every probe run" in format_comparisons(comparisons)
    with pytest.raises(ValueError, match="fit must be one of"):
        validate.compare_served(runs, _mesh(0.01), REQUESTS, fit="median")


def test_compare_without_probes_simulates_once(monkeypatch):
    monkeypatch.setattr(
        validate, "run_real", lambda config, mode, probe=False: _real_run(mode, _mesh(0.01))
    )
    runs = validate.serve(_config(), ("colocated",), repeats=2).runs
    (c,) = validate.compare_served(runs, _mesh(0.01), REQUESTS)
    assert c.sim_runs == () and c.fits == () and c.sim_once is not None
    assert c.sim_of(1) == c.sim_records


def _records(ttft: float, n: int = 3) -> list[RequestRecord]:
    return [
        RequestRecord(i, 0.0, 0.0, ttft + 0.02, 100, 3, 3, (ttft, ttft + 0.01, ttft + 0.02))
        for i in range(n)
    ]


def test_comparison_each_pairs_every_run_with_its_own_simulation():
    fast, slow = _mesh(0.010), _mesh(0.050)
    sims = [simulate(mesh_topology("colocated", c), c, REQUESTS) for c in (fast, slow)]
    runs = [RealRun(list(s.records), s.summary.duration_s, None) for s in sims]
    c = comparison_each("colocated", runs, sims)
    assert [v["TTFT p50"] for v in c.run_ratios()] == [1.0, 1.0]
    assert c.ratios()["TTFT p50"] == pytest.approx(1.0)
    # the one-simulation comparison of the same runs: the fast sim against the slow run too
    once = validate.comparison("colocated", runs, sims[0])
    assert once.run_ratios()[1]["TTFT p50"] < 0.8
    assert c.sim_timings is not None and c.real_timings is None
    by_mode = json.loads(records_json([c]))["colocated"]
    assert [r["run"] for r in by_mode["sim"]] == [0] * len(REQUESTS) + [1] * len(REQUESTS)
    assert "against its own simulation" in format_runs([c])
    assert "both sides pooled over 2 runs" in format_comparisons([c])
    with pytest.raises(ValueError, match="2 real runs, 1 simulations"):
        comparison_each("colocated", runs, sims[:1])


def test_a_run_without_its_probe_is_refused(monkeypatch):
    monkeypatch.setattr(
        validate, "run_real", lambda config, mode, probe=False: RealRun(_records(0.1), 1.0, None)
    )
    for fit in ("pooled", "each"):
        with pytest.raises(ValueError, match="without its probe"):
            validate.compare_served(
                validate.serve(_config(), MODES, probe=True).runs, _mesh(0.01), REQUESTS, fit=fit
            )


@pytest.mark.slow  # seconds: left out of make test-fast
def test_cli_prints_each_repeats_fit(monkeypatch, capsys, tmp_path):
    from kvmesh.sim.specs import write_device

    from kvmesh.cli import main

    monkeypatch.setattr(
        validate,
        "run_real",
        lambda config, mode, probe=False: _real_run(mode, _mesh(0.02)),
    )
    spec = write_device(_engine(), tmp_path / "cpu-like.json")
    args = ["sim", "--validate", "--probe-each-run", "--repeats", "2", "--model", "kvmesh-tiny"]
    args += ["--device", str(spec), "--num-requests", "4", "--input-len-range", "100:250"]
    args += ["--output-len-range", "8:8", "--request-rate", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "each repeat's fit to the probes on its own meshes" in out
    assert "| run | engine scale |" in out
    assert out.count("\n| 1 | colocated x") == 1 and out.count("\n| 2 | colocated x") == 1
    assert "each real run against its own simulation" in out
    assert "both sides pooled over 2 runs, each simulated with its own fit" in out
    assert "the fit to all 4 probe runs (each figure their median, the jitter their gaps" in out
    assert out.count("\n| all | colocated x") == 1
    assert "pooled: the real side is every run's records (2 x 4)" in out
    assert "the simulation fitted to every probe run of the validation" in out
    assert "a typical run (each real figure the median over the runs)" in out


def test_cli_refuses_no_repeats_with_probe_each_run(capsys):
    from kvmesh.cli import main

    assert main(["sim", "--validate", "--probe-each-run", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_a_typical_run_is_each_figures_median_over_the_runs():
    """One disturbed run of three moves the pooled p99 but not the typical run's figures."""
    from kvmesh.loadgen.serve_metrics import summarize
    from kvmesh.sim.validate import median_summary_ratios

    def run(gap: float, ttft: float) -> list[RequestRecord]:
        return [
            RequestRecord(i, i, i, i + ttft + 9 * gap, 64, 10, 10,
                          tuple(i + ttft + k * gap for k in range(10)))
            for i in range(5)
        ]  # fmt: skip

    runs = [run(0.002, 0.1), run(0.003, 0.2), run(0.010, 0.9)]  # the third disturbed
    sim = summarize(run(0.003, 0.2), 1.0)
    typical = median_summary_ratios([summarize(r, 1.0) for r in runs], sim)
    assert typical == {
        "TTFT p50": pytest.approx(1.0),
        "TTFT p99": pytest.approx(1.0),
        "ITL p50": pytest.approx(1.0),
        "ITL p99": pytest.approx(1.0),
    }
    pooled = summarize([r for x in runs for r in x], 1.0)
    assert sim.itl.p99_ms / pooled.itl.p99_ms < 0.5  # the pooled tail is the disturbed run's
    assert median_summary_ratios([summarize([], 1.0)], sim)["ITL p50"] is None


def test_each_runs_cpu_steal_is_printed_beside_its_ratios():
    """A repeat the hypervisor slowed during its workload but not during its probes shows it."""
    from kvmesh.sim.validate import comparison

    sim = simulate(mesh_topology("colocated", _mesh(0.01)), _mesh(0.01), REQUESTS)
    runs = [
        RealRun(list(sim.records), sim.summary.duration_s, None, steal=Steal(0.01, 0.02)),
        RealRun(list(sim.records), sim.summary.duration_s, None, steal=Steal(0.02, 0.31)),
        RealRun(list(sim.records), sim.summary.duration_s, None),  # not measured
    ]
    c = comparison("colocated", runs, sim)
    assert c.steals == tuple(r.steal for r in runs)
    out = format_runs([c])
    assert "| CPU steal |" in out
    assert "| 0/0 | 1% / 2% |" not in out  # the ratio cells come first
    rows = [line for line in out.splitlines() if line.startswith("| colocated | ")]
    assert rows[0].endswith("| 1% / 2% |") and rows[1].endswith("| 2% / 31% |")
    assert rows[2].endswith("| - / - |")
    assert json.loads(validate.records_json([c]))["colocated"]["real_steal"][1] == {
        "probes": 0.02,
        "workload": 0.31,
    }


def _steal_run(steal: Steal) -> RealRun:
    return RealRun(_records(0.1), 1.0, None, steal=steal)


def test_a_repeat_the_hypervisor_disturbed_is_served_again():
    """Repeat 2's disagg mesh lost 12 % of the CPU during its probes: both its runs are set
    aside and the repeat is served again; the comparison gets the undisturbed ones."""
    steals = iter(
        [
            *(Steal(0.01, 0.0), Steal(0.0, 0.02)),  # repeat 1
            *(Steal(0.0, 0.01), Steal(0.12, 0.01)),  # repeat 2, disagg disturbed
            *(Steal(0.0, 0.0), Steal(0.01, 0.03)),  # repeat 2 again
        ]
    )
    served: list[str] = []

    def run(config: ServeBenchConfig, mode: str, probe: bool) -> RealRun:
        served.append(mode)
        return _steal_run(next(steals))

    out = validate.serve(_config(), MODES, repeats=2, max_steal=0.05, redo=2, run=run)
    assert served == list(MODES) * 3
    assert [r.steal for r in out.runs["colocated"]] == [Steal(0.01, 0.0), Steal(0.0, 0.0)]
    assert [r.steal for r in out.runs["disagg"]] == [Steal(0.0, 0.02), Steal(0.01, 0.03)]
    assert out.set_aside == (SetAside(1, "disagg", Steal(0.12, 0.01)),)
    assert out.kept_disturbed() == []


def test_a_disturbed_repeat_is_kept_and_flagged_when_no_redo_is_left():
    def run(config: ServeBenchConfig, mode: str, probe: bool) -> RealRun:
        return _steal_run(Steal(0.0, 0.2) if mode == "disagg" else Steal(None, None))

    out = validate.serve(_config(), MODES, repeats=2, max_steal=0.05, redo=1, run=run)
    assert len(out.set_aside) == 1 and len(out.runs["disagg"]) == 2
    assert out.kept_disturbed() == [(0, "disagg", Steal(0.0, 0.2)), (1, "disagg", Steal(0.0, 0.2))]
    # without a threshold nothing is redone or flagged; unmeasured steal never counts
    plain = validate.serve(_config(), MODES, repeats=2, run=run)
    assert plain.set_aside == () and plain.kept_disturbed() == []
    assert not validate.disturbed(_steal_run(Steal(None, None)), 0.0)
    with pytest.raises(ValueError, match="--redo must be 0 or more"):
        validate.serve(_config(), MODES, redo=-1, run=run)
    with pytest.raises(ValueError, match="--max-steal must be a share"):
        validate.serve(_config(), MODES, max_steal=5.0, run=run)


def test_cli_prints_the_repeats_served_again(monkeypatch, capsys, tmp_path):
    from kvmesh.sim.specs import write_device

    from kvmesh.cli import main

    steals = iter([Steal(0.0, 0.3), Steal(0.0, 0.0)] + [Steal(0.0, 0.0)] * 2)
    monkeypatch.setattr(
        validate,
        "run_real",
        lambda config, mode, probe=False: dataclasses.replace(
            _real_run(mode, _mesh(0.02)), steal=next(steals)
        ),
    )
    spec = write_device(_engine(), tmp_path / "cpu-like.json")
    args = ["sim", "--validate", "--model", "kvmesh-tiny", "--device", str(spec)]
    args += ["--num-requests", "4", "--input-len-range", "100:250", "--output-len-range", "8:8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        "repeat 1 served again: the hypervisor took 0% / 30% of the CPU during the colocated" in out
    )
    assert main([*args, "--redo", "-1"]) == 2
    assert "--redo must be 0 or more" in capsys.readouterr().err
