"""The simulator against the real mesh: one workload, simulated and served, colocated and disagg.

The real side is ``kvmesh bench serve --compare``'s machinery: ``serve_prompts.build_workload``
makes the prompts (exact token lengths, from the seed), ``arrivals.arrival_times`` the send
times, ``kvmesh.testing.mesh.local_mesh`` a fresh mesh of each mode on this machine's cores (kvmesh up's
defaults, one prefill worker) and ``sse_client.run_requests`` the streamed requests. The
simulated side runs the same lengths and arrival times on a topology that mirrors that mesh:
one worker of each role on one shared device (the calibrated CPU spec), the mesh's step budgets
(512 tokens for colocated and prefill chunks), its 256 MiB KV pool per worker, and the threads
and niceness ``kvmesh up`` gives each role (``cpu_plan.plan_cpus``): on 2 cores colocated runs 2
threads; disagg runs decode on 1 thread and prefill on 1, each on a core of its own (the
partition: two single-threaded workers on two cores share nothing here either), or, with
``--prefill-nice N``, decode on 2 threads and prefill on 2 at nice N.

With ``repeats`` > 1 the same workload is served by ``repeats`` fresh meshes of each mode (the
modes taking turns, so that a slow drift of the machine reaches both) and the simulation is
compared with all their records pooled: the percentiles over ``repeats`` x requests, so that a
real p99 is not one request of one run. Each run's own sim/real ratios are kept too
(``Comparison.run_ratios``), to show how far the real side moves from run to run. The simulator
is deterministic (its jitter is a seeded draw), so its records are counted ``repeats`` times
(``pooled_summary``): the two sides' percentiles are then taken over as many requests.

With ``probe`` (``serve``) every mesh serves the calibration probe (``probe.serve_probe``) just
before the validation's warm-up and workload and again just after it: the machine's speed
drifts over minutes, so a calibration made minutes before is stale by the time the validation
runs. ``compare_served`` then fits the engine scale and mesh overheads (``fit_run``, on the
spec's engine figures alone) either to every probe run of the validation (``pooled``: two per
mesh, pooled as ``--calibrate --probe-runs`` pools its runs: each figure their median, the
jitter their gaps together) and simulates once, or to each repeat's own two probe runs
(``each``) and simulates each repeat with its own fit, each real run then compared with its
own simulation. One probe run is noisy: its
p99 gap rests on a few gaps, and one disturbed run gave a repeat a jitter three times the
others' (its simulated disagg ITL p99 2.2x the real one).

This module serves the repeats (``serve``); one run on a real mesh is real_runs.py's, the
comparison and the fits validate_compare.py's, the tables validate_report.py's (their names are
all importable from here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.sim.real_runs import RealRun, Steal, run_real, scrape
from kvmesh.sim.validate_compare import (
    FITS,
    MESH_CHUNK_TOKENS,
    MESH_KV_CACHE_BYTES,
    MESH_MAX_NUM_SEQS,
    TOLERANCE,
    Comparison,
    RunFit,
    compare_served,
    comparison,
    comparison_each,
    engine_only,
    figures,
    fit_run,
    median_summary_ratios,
    mesh_topology,
    pooled_summary,
    probe_runs,
    ratios,
    within,
)
from kvmesh.sim.validate_report import format_comparisons, format_runs, records_json


def disturbed(run: RealRun, max_steal: float) -> bool:
    """Whether the hypervisor took more than ``max_steal`` of the CPU during ``run``'s probes
    or its workload (a share not measured is not counted)."""
    return any(
        share is not None and share > max_steal for share in (run.steal.probes, run.steal.workload)
    )


@dataclass(frozen=True, slots=True)
class SetAside:
    """A repeat's run served again because the hypervisor disturbed it (``disturbed``)."""

    repeat: int  # 0-based
    mode: str
    steal: Steal


@dataclass(frozen=True, slots=True)
class Served:
    """The runs kept, by mode (run ``k`` of each mode is repeat ``k``), and those set aside."""

    runs: dict[str, list[RealRun]]
    set_aside: tuple[SetAside, ...] = ()
    max_steal: float | None = None

    def kept_disturbed(self) -> list[tuple[int, str, Steal]]:
        """The kept runs that are disturbed all the same (no redo was left)."""
        if self.max_steal is None:
            return []
        return [
            (k, mode, run.steal)
            for mode, rs in self.runs.items()
            for k, run in enumerate(rs)
            if disturbed(run, self.max_steal)
        ]


def serve(
    config: ServeBenchConfig,
    modes: tuple[str, ...],
    repeats: int = 1,
    probe: bool = False,
    max_steal: float | None = None,
    redo: int = 0,
    run: Callable[[ServeBenchConfig, str, bool], RealRun] | None = None,
) -> Served:
    """The workload served by ``repeats`` fresh meshes of each mode (the modes in turn, so that
    a slow drift of the machine reaches both), each probed before and after it with ``probe``.

    With ``max_steal``, a repeat one of whose runs the hypervisor took more than that share of
    the CPU from (during its probes or its workload) is served again, both modes, at most
    ``redo`` times over the whole validation: its runs are set aside, not compared. A repeat
    still disturbed when no redo is left is kept, and ``Served.kept_disturbed`` says so."""
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    if redo < 0:
        raise ValueError(f"--redo must be 0 or more, got {redo}")
    if max_steal is not None and not 0 <= max_steal < 1:
        raise ValueError(f"--max-steal must be a share in [0, 1), got {max_steal}")
    serve_one = run or run_real
    runs: dict[str, list[RealRun]] = {mode: [] for mode in modes}
    set_aside: list[SetAside] = []
    k = 0
    while k < repeats:
        served = {mode: serve_one(config, mode, probe) for mode in modes}
        bad = [] if max_steal is None else [m for m, r in served.items() if disturbed(r, max_steal)]
        if bad and redo > 0:
            redo -= 1
            set_aside += [SetAside(k, mode, served[mode].steal) for mode in bad]
            continue
        for mode, real in served.items():
            runs[mode].append(real)
        k += 1
    return Served(runs, tuple(set_aside), max_steal)


__all__ = [
    "FITS",
    "MESH_CHUNK_TOKENS",
    "MESH_KV_CACHE_BYTES",
    "MESH_MAX_NUM_SEQS",
    "TOLERANCE",
    "Comparison",
    "RealRun",
    "RunFit",
    "Served",
    "SetAside",
    "Steal",
    "compare_served",
    "comparison",
    "comparison_each",
    "disturbed",
    "engine_only",
    "figures",
    "fit_run",
    "format_comparisons",
    "format_runs",
    "median_summary_ratios",
    "mesh_topology",
    "pooled_summary",
    "probe_runs",
    "ratios",
    "records_json",
    "run_real",
    "scrape",
    "serve",
    "within",
]
