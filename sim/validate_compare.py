"""The simulator against the real runs (validate.py): the figures compared (p50 and p99 TTFT and
ITL) and their sim / real ratios, a mode's real runs pooled against its simulation
(``Comparison``), the mesh's simulated twin (``mesh_topology``), and the engine scale and mesh
overheads fitted to the probes the validation's meshes served (``fit_run``, ``compare_served``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord, Summary, summarize
from kvmesh.sim.cluster import SimResult, simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.engine_scale import EngineScale, EngineScaleFit
from kvmesh.sim.engine_timings import EngineTimings, pooled
from kvmesh.sim.mesh_terms import MeshOverheads
from kvmesh.sim.overheads import OverheadFit
from kvmesh.sim.probe import ProbeRecords
from kvmesh.sim.real_runs import RealRun, Steal
from kvmesh.sim.specs import DeviceSpec
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import SimRequest

MESH_CHUNK_TOKENS = 512  # decode/colocated --max-num-batched-tokens and prefill --chunk-tokens
MESH_MAX_NUM_SEQS = 64
# a colocated step with no decode: the oldest prompt's budget (--max-num-batched-tokens-no-decode)
MESH_NO_DECODE_TOKENS = 4096
MESH_KV_CACHE_BYTES = 256 << 20
TOLERANCE = 0.25  # issue #12: the simulator's p50 and p99 TTFT and ITL within 25 % of the mesh's


def figures(summary: Summary) -> dict[str, float | None]:
    """p50 and p99 TTFT and ITL in ms, the figures the validation compares (None where the
    summary has none)."""
    out: dict[str, float | None] = {}
    for metric in ("ttft", "itl"):
        stats = getattr(summary, metric)
        for p in ("p50_ms", "p99_ms"):
            out[f"{metric.upper()} {p[:3]}"] = None if stats is None else getattr(stats, p)
    return out


def _ratio(sim: float | None, real: float | None) -> float | None:
    return sim / real if sim is not None and real is not None and real > 0 else None


def ratios(real: Summary, sim: Summary) -> dict[str, float | None]:
    """sim / real of p50 and p99 TTFT and ITL (None where either side has none)."""
    r = figures(real)
    return {key: _ratio(s, r[key]) for key, s in figures(sim).items()}


def median_summary_ratios(runs: Sequence[Summary], sim: Summary) -> dict[str, float | None]:
    """sim / real of p50 and p99 TTFT and ITL, each real figure the median over ``runs``: a
    typical run's, which one disturbed run of three does not move (None where a side has none)."""
    per_run = [figures(r) for r in runs]
    out: dict[str, float | None] = {}
    for key, s in figures(sim).items():
        real = [f[key] for f in per_run]
        typical = statistics.median(real) if real and None not in real else None  # type: ignore[type-var]
        out[key] = _ratio(s, typical)
    return out


def within(values: dict[str, float | None], tolerance: float = TOLERANCE) -> int:
    """How many of the ratios are within ``tolerance`` of 1 (a missing one is not)."""
    return sum(1 for v in values.values() if v is not None and abs(v - 1) <= tolerance + 1e-12)


def pooled_summary(runs: Sequence[tuple[Sequence[RequestRecord], float]]) -> Summary:
    """Several runs of one workload as one: every run's records (TTFT, ITL percentiles over all
    of them), over the runs' summed duration."""
    if not runs:
        raise ValueError("no runs to pool")
    records = [r for run, _ in runs for r in run]
    return summarize(records, sum(duration for _, duration in runs))


@dataclass(frozen=True, slots=True)
class RunFit:
    """A calibration made on validation meshes (``--probe-each-run``): the engine scale (None:
    their /metrics were unread) and the mesh overheads fitted to the probe runs they served
    (one repeat's, or every repeat's), and the cost model simulated with them."""

    mesh: OverheadFit
    engine_scale: EngineScaleFit | None
    cost: CostModel


@dataclass(frozen=True, slots=True)
class Comparison:
    """One mode: the real runs pooled (``real``) against the simulation counted as many times
    (``sim``); ``real_runs`` and ``run_summaries`` keep each real run apart, ``sim_once`` is
    the simulation counted once (a run's own counterpart).

    With a calibration per repeat (``sim_runs`` not empty) run ``k`` has a simulation of its
    own, ``sim_runs[k]``, with ``fits[k].cost``: ``sim`` pools them, ``sim_records`` is theirs run
    after run, ``sim_timings`` their pooled means, and ``sim_once`` is None. With one calibration
    fitted to every probe of the validation, ``fits`` holds it alone and ``sim_runs`` is empty."""

    mode: str
    real: Summary
    sim: Summary
    real_runs: tuple[tuple[RequestRecord, ...], ...] = ()
    sim_records: tuple[RequestRecord, ...] = ()
    real_timings: EngineTimings | None = None  # pooled; None: a mesh's /metrics were unread
    sim_timings: EngineTimings | None = None
    run_summaries: tuple[Summary, ...] = ()
    sim_once: Summary | None = None
    sim_runs: tuple[SimResult, ...] = ()
    fits: tuple[RunFit, ...] = ()
    steals: tuple[Steal, ...] = ()  # each real run's

    @property
    def real_records(self) -> tuple[RequestRecord, ...]:
        """Every real run's records, run after run."""
        return tuple(r for run in self.real_runs for r in run)

    def sim_of(self, run: int) -> tuple[RequestRecord, ...]:
        """The simulated records real run ``run`` is compared with: its own simulation's, else
        the one simulation's."""
        return self.sim_runs[run].records if self.sim_runs else self.sim_records

    def ratios(self) -> dict[str, float | None]:
        """sim / real of p50 and p99 TTFT and ITL, the real runs pooled."""
        return ratios(self.real, self.sim)

    def typical_ratios(self) -> dict[str, float | None]:
        """sim / real with each real figure the median over the runs (one simulation only)."""
        assert not self.sim_runs, "one simulation for every run"
        return median_summary_ratios(self.run_summaries, self.sim_once or self.sim)

    def run_ratios(self) -> list[dict[str, float | None]]:
        """Each real run's own sim / real ratios (against its own simulation, else the
        simulation counted once)."""
        if self.sim_runs:
            return [
                ratios(real, sim.summary)
                for real, sim in zip(self.run_summaries, self.sim_runs, strict=True)
            ]
        once = self.sim_once or self.sim
        return [ratios(real, once) for real in self.run_summaries]


def mesh_topology(mode: str, cost: CostModel, prefill_nice: int = 0) -> Topology:
    """The simulated twin of ``local_mesh(mode, prefill_nice=...)`` on the spec's cores."""
    from kvmesh.commands.cpu_plan import plan_cpus

    threads = plan_cpus(
        frozenset(range(cost.device.cores)),  # a simulated device's cores are all its own
        mode=mode,
        device="cpu",
        decode_workers=1,
        prefill_workers=1,
        prefill_nice=prefill_nice,
    ).threads()
    capacity = MESH_KV_CACHE_BYTES // cost.kv_bytes_per_token
    return Topology(
        mode,  # type: ignore[arg-type]
        num_decode=1,
        num_prefill=1 if mode == "disagg" else 0,
        chunk_tokens=MESH_CHUNK_TOKENS,
        max_num_seqs=MESH_MAX_NUM_SEQS,
        kv_capacity_tokens=capacity,
        shared_device=True,
        decode_threads=threads.get("decode", threads.get("colocated")),
        prefill_threads=threads.get("prefill"),
        prefill_nice=prefill_nice if mode == "disagg" else 0,
        no_decode_chunk_tokens=MESH_NO_DECODE_TOKENS if mode == "colocated" else 0,
    )


def engine_only(device: DeviceSpec) -> DeviceSpec:
    """``device`` with its engine scales at 1 and no mesh overheads: its engine figures alone,
    as calibration has them when it fits the probe."""
    return MeshOverheads().apply(EngineScale().apply(device))


def fit_run(cost: CostModel, probe_runs: Sequence[Mapping[str, ProbeRecords]]) -> RunFit:
    """The engine scale and mesh overheads fitted to the median of ``probe_runs`` (each a probe
    by mode) on ``cost``'s engine figures (its own scales and overheads are not used), applied
    as ``calibrate.calibrate`` applies them: the scale, then the overheads."""
    from kvmesh.sim.probe_fit import fit_probe, pool_probe_runs

    engine = engine_only(cost.device)
    mesh, scaled = fit_probe(engine, cost.model, pool_probe_runs(list(probe_runs)))
    spec = engine if scaled is None else scaled.scale.apply(engine)
    return RunFit(mesh, scaled, CostModel(cost.model, mesh.overheads.apply(spec), cost.tp))


def probe_runs(
    runs: Mapping[str, Sequence[RealRun]], repeat: int | None = None
) -> list[dict[str, ProbeRecords]]:
    """The probe runs (a probe of each mode) that repeat ``repeat``'s meshes served, or every
    repeat's (None): its meshes' first probes, then their second."""
    repeats = range(min(len(r) for r in runs.values())) if repeat is None else [repeat]
    out = []
    for k in repeats:
        served = {mode: rs[k] for mode, rs in runs.items()}
        if any(not run.probes for run in served.values()):
            raise ValueError("a validation run without its probe")
        count = min(len(run.probes) for run in served.values())
        out += [{mode: run.probes[i] for mode, run in served.items()} for i in range(count)]
    return out


FITS = ("spec", "pooled", "each")


def compare_served(
    runs: Mapping[str, Sequence[RealRun]],
    cost: CostModel,
    requests: list[SimRequest],
    prefill_nice: int = 0,
    fit: str = "spec",
) -> list[Comparison]:
    """The served ``runs`` (by mode) against the simulation of ``requests``: with ``cost`` as it
    is (``spec``); fitted to every probe run of the validation (``pooled``, one
    simulation); or each repeat fitted to its own probe runs (``each``, a simulation a repeat)."""
    if fit not in FITS:
        raise ValueError(f"fit must be one of {', '.join(FITS)}, got {fit!r}")

    def simulated(mode: str, c: CostModel) -> SimResult:
        return simulate(mesh_topology(mode, c, prefill_nice), c, requests)

    if fit == "spec":
        return [comparison(mode, rs, simulated(mode, cost)) for mode, rs in runs.items()]
    if fit == "pooled":
        pooled_fit = fit_run(cost, probe_runs(runs))
        return [
            dataclasses.replace(
                comparison(mode, rs, simulated(mode, pooled_fit.cost)), fits=(pooled_fit,)
            )
            for mode, rs in runs.items()
        ]
    repeats = min(len(rs) for rs in runs.values())
    fits = [fit_run(cost, probe_runs(runs, k)) for k in range(repeats)]
    return [
        comparison_each(mode, rs, [simulated(mode, f.cost) for f in fits], fits)
        for mode, rs in runs.items()
    ]


def _pooled_timings(timings: Sequence[EngineTimings | None]) -> EngineTimings | None:
    """The runs' engine means pooled; None if one run has none."""
    if any(t is None for t in timings):
        return None
    return pooled(timings)  # type: ignore[arg-type]


def comparison(mode: str, runs: Sequence[RealRun], sim: SimResult) -> Comparison:
    """The real runs of a mode pooled against its simulation counted as many times."""
    sim_once = sim.summary
    return Comparison(
        mode,
        pooled_summary([(run.records, run.duration_s) for run in runs]),
        pooled_summary([(sim.records, sim_once.duration_s)] * len(runs)),
        tuple(tuple(run.records) for run in runs),
        sim.records,
        _pooled_timings([run.timings for run in runs]),
        sim.timings,
        tuple(summarize(run.records, run.duration_s) for run in runs),
        sim_once,
        steals=tuple(run.steal for run in runs),
    )


def comparison_each(
    mode: str, runs: Sequence[RealRun], sims: Sequence[SimResult], fits: Sequence[RunFit] = ()
) -> Comparison:
    """The real runs of a mode pooled against their own simulations pooled (run ``k``'s
    simulated with ``fits[k].cost``, the calibration on its own mesh); each run's ratios are
    against its own simulation."""
    if len(sims) != len(runs) or (fits and len(fits) != len(runs)):
        raise ValueError(f"{len(runs)} real runs, {len(sims)} simulations, {len(fits)} fits")
    return Comparison(
        mode,
        pooled_summary([(run.records, run.duration_s) for run in runs]),
        pooled_summary([(sim.records, sim.summary.duration_s) for sim in sims]),
        tuple(tuple(run.records) for run in runs),
        tuple(r for sim in sims for r in sim.records),
        _pooled_timings([run.timings for run in runs]),
        _pooled_timings([sim.timings for sim in sims]),
        tuple(summarize(run.records, run.duration_s) for run in runs),
        None,
        tuple(sims),
        tuple(fits),
        tuple(run.steal for run in runs),
    )
