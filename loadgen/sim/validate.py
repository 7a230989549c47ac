"""The simulator against the real mesh: one workload, simulated and served, colocated and disagg.

The real side is ``kvmesh bench serve --compare``'s machinery: ``bench_serve.build_workload``
makes the prompts (exact token lengths, from the seed), ``arrivals.arrival_times`` the send
times, ``bench_mesh.local_mesh`` a fresh mesh of each mode on this machine's cores (kvmesh up's
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.serve_metrics import RequestRecord, Summary, summarize
from kvmesh.loadgen.sim.cluster import SimResult, simulate
from kvmesh.loadgen.sim.cost import CostModel
from kvmesh.loadgen.sim.engine_scale import EngineScale, EngineScaleFit
from kvmesh.loadgen.sim.engine_timings import EngineTimings, merge_scrapes, pooled
from kvmesh.loadgen.sim.overheads import MeshOverheads, OverheadFit
from kvmesh.loadgen.sim.probe import ProbeRecords
from kvmesh.loadgen.sim.specs import DeviceSpec
from kvmesh.loadgen.sim.topology import Topology
from kvmesh.loadgen.sim.workload import SimRequest

MESH_CHUNK_TOKENS = 512  # decode/colocated --max-num-batched-tokens and prefill --chunk-tokens
MESH_MAX_NUM_SEQS = 64
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
    )


def scrape(urls: list[str]) -> dict[str, float] | None:
    """Every service's ``/metrics`` summed by name; None if one cannot be read."""
    import urllib.request

    from kvmesh.loadgen.server_breakdown import parse_prometheus

    scrapes = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5.0) as resp:
                scrapes.append(parse_prometheus(resp.read().decode()))
        except OSError:
            return None
    return merge_scrapes(scrapes)


@dataclass(frozen=True, slots=True)
class Steal:
    """The CPU time a VM's hypervisor took (``cpu_steal``) during a real run's probes and
    during its workload (None: not measured, or no /proc/stat)."""

    probes: float | None = None
    workload: float | None = None

    def cell(self) -> str:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.0%}"

        return f"{pct(self.probes)} / {pct(self.workload)}"


@dataclass(frozen=True, slots=True)
class RealRun:
    """One mesh's validation run: its records, how long it took, the engines' means over it
    (None: its /metrics were unread), and the probes it served before and after the workload
    (none: not probed)."""

    records: list[RequestRecord]
    duration_s: float
    timings: EngineTimings | None
    probes: tuple[ProbeRecords, ...] = ()  # the probe before the workload and after it
    steal: Steal = Steal()  # the hypervisor's share of the CPU meanwhile


def run_real(config: ServeBenchConfig, mode: str, probe: bool = False) -> RealRun:
    """Serve the workload on a fresh local mesh of ``mode``; with ``probe``, serve the
    calibration probe on that mesh before the warm-up and the workload, and again (other
    prompts) after them."""
    from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times
    from kvmesh.loadgen.bench_mesh import local_mesh
    from kvmesh.loadgen.bench_serve import build_workload
    from kvmesh.loadgen.cpu_steal import CpuTimes, read_cpu_times, steal_share, steal_share_over
    from kvmesh.loadgen.sim.probe import serve_probe
    from kvmesh.loadgen.sse_client import run_requests

    prompts, _ = build_workload(config)
    process = ArrivalProcess(config.arrival, config.request_rates[0], config.burstiness)
    times = arrival_times(process, len(prompts), random.Random(f"{config.seed}:arrivals"))
    with local_mesh(
        mode,
        config.transport,
        model=config.model,
        local_prefill_threshold=0,
        prefill_nice=config.prefill_nice,
    ) as mesh:
        probe_spans: list[tuple[CpuTimes | None, CpuTimes | None]] = []

        def probed(seed: str) -> ProbeRecords:
            before = read_cpu_times()
            records = serve_probe(mesh, mode, config.model, config.timeout_s, seed=seed)
            probe_spans.append((before, read_cpu_times()))
            return records

        probes = [probed("probe")] if probe else []
        endpoint = config.endpoint(mesh.url)
        # a prompt of its own (prompts[0] reversed): the warm-up must not leave the first
        # request's prompt in the prefix cache, which the simulator does not model
        warm = dataclasses.replace(
            prompts[0], token_ids=prompts[0].token_ids[::-1], text=None, output_len=4
        )
        asyncio.run(run_requests(endpoint, [warm], [0.0], timeout_s=config.timeout_s))
        urls = list(mesh.metrics_urls.values())
        before = scrape(urls)
        started = read_cpu_times()
        records, duration_s = asyncio.run(
            run_requests(endpoint, prompts, times, timeout_s=config.timeout_s)
        )
        ended = read_cpu_times()
        after = scrape(urls)
        if probe:
            probes.append(probed("probe-after"))
    timings = None if before is None or after is None else EngineTimings.between(before, after)
    steal = Steal(steal_share_over(probe_spans), steal_share(started, ended))
    return RealRun(records, duration_s, timings, tuple(probes), steal)


def engine_only(device: DeviceSpec) -> DeviceSpec:
    """``device`` with its engine scales at 1 and no mesh overheads: its engine figures alone,
    as calibration has them when it fits the probe."""
    return MeshOverheads().apply(EngineScale().apply(device))


def fit_run(cost: CostModel, probe_runs: Sequence[Mapping[str, ProbeRecords]]) -> RunFit:
    """The engine scale and mesh overheads fitted to the median of ``probe_runs`` (each a probe
    by mode) on ``cost``'s engine figures (its own scales and overheads are not used), applied
    as ``calibrate.calibrate`` applies them: the scale, then the overheads."""
    from kvmesh.loadgen.sim.calibrate import fit_probe, pool_probe_runs

    engine = engine_only(cost.device)
    mesh, scaled = fit_probe(engine, cost.model, pool_probe_runs(list(probe_runs)))
    spec = engine if scaled is None else scaled.scale.apply(engine)
    return RunFit(mesh, scaled, CostModel(cost.model, mesh.overheads.apply(spec), cost.tp))


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


def records_json(comparisons: list[Comparison]) -> str:
    """Every request's real and simulated record (token times included), by mode; each real
    record says which run (0, 1, ...) it came from, and so does each simulated one where every
    run has its own simulation."""
    import json

    def record(r: RequestRecord) -> dict[str, object]:
        return {
            "index": r.index,
            "arrival_s": r.arrival_s,
            "send_s": r.send_s,
            "end_s": r.end_s,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "chunk_times": list(r.chunk_times),
            "error": r.error,
        }

    return json.dumps(
        {
            c.mode: {
                "real": [{**record(r), "run": k} for k, run in enumerate(c.real_runs) for r in run],
                "sim": (
                    [
                        {**record(r), "run": k}
                        for k, sim in enumerate(c.sim_runs)
                        for r in sim.records
                    ]
                    if c.sim_runs
                    else [record(r) for r in c.sim_records]
                ),
                "real_steal": [dataclasses.asdict(steal) for steal in c.steals],
                "real_timings": c.real_timings and dataclasses.asdict(c.real_timings),
                "sim_timings": c.sim_timings and dataclasses.asdict(c.sim_timings),
            }
            for c in comparisons
        },
        indent=1,
    )


def _ratio_cells(values: dict[str, float | None]) -> list[str]:
    return ["-" if r is None else f"{r:.2f}x" for r in values.values()]


def format_comparisons(comparisons: list[Comparison]) -> str:
    """The pooled table: real (every run's records) and simulated percentiles, sim / real, and
    how many ratios are within ``TOLERANCE``."""

    def ms(stats, attr: str) -> str:
        return "-" if stats is None else f"{getattr(stats, attr):.0f}"

    lines = [
        "| mode | | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for name, s in (("real", c.real), ("sim", c.sim)):
            cells = [
                ms(s.ttft, "p50_ms"),
                ms(s.ttft, "p99_ms"),
                ms(s.itl, "p50_ms"),
                ms(s.itl, "p99_ms"),
            ]
            lines.append(f"| {c.mode} | {name} | {' | '.join(cells)} | {s.num_failed} |")
        lines.append(f"| {c.mode} | sim/real | {' | '.join(_ratio_cells(c.ratios()))} | |")
    runs = max((len(c.run_summaries) for c in comparisons), default=1)
    counts = [(c.mode, within(c.ratios()), len(c.ratios())) for c in comparisons]
    pooled_note = f" (the real side pooled over {runs} runs)" if runs > 1 else ""
    if runs > 1 and any(c.sim_runs for c in comparisons):
        pooled_note = f" (both sides pooled over {runs} runs, each simulated with its own fit)"
    elif any(c.fits for c in comparisons):
        real_side = f"the real side pooled over {runs} runs; " if runs > 1 else ""
        pooled_note = f" ({real_side}the simulation fitted to every probe run of the validation)"
    lines.append(
        f"within {TOLERANCE * 100:.0f} %{pooled_note}: "
        + ", ".join(f"{mode} {k}/{n}" for mode, k, n in counts)
        + f": {sum(k for _, k, _ in counts)} of {sum(n for _, _, n in counts)} figures"
    )
    if runs > 1 and not any(c.sim_runs for c in comparisons):
        typical = [(c.mode, c.typical_ratios()) for c in comparisons]
        lines.append(
            "a typical run (each real figure the median over the runs) against the simulation: "
            + "; ".join(f"{mode} {' / '.join(_ratio_cells(r))}" for mode, r in typical)
            + f": {sum(within(r) for _, r in typical)} of {sum(len(r) for _, r in typical)} "
            "figures within"
        )
    return "\n".join(lines)


def format_runs(comparisons: list[Comparison]) -> str:
    """Each real run's own sim / real ratios, and their range per figure: how far the real side
    moves between runs of the same requests."""
    own = any(c.sim_runs for c in comparisons)
    lines = [
        f"each real run against {'its own' if own else 'the'} simulation (sim / real; CPU "
        "steal: the share of the CPU the VM's hypervisor took during the run's probes and its "
        "workload):",
        f"| mode | run | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | within {TOLERANCE * 100:.0f} % | failed "
        "| CPU steal |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        per_run = c.run_ratios()
        steals = c.steals or (Steal(),) * len(per_run)
        for k, (values, real, steal) in enumerate(
            zip(per_run, c.run_summaries, steals, strict=True)
        ):
            lines.append(
                f"| {c.mode} | {k + 1} | {' | '.join(_ratio_cells(values))} | "
                f"{within(values)}/{len(values)} | {real.num_failed} | {steal.cell()} |"
            )
        if len(per_run) > 1:
            cells = []
            for key in per_run[0]:
                got = [v[key] for v in per_run if v[key] is not None]
                cells.append(f"{min(got):.2f}-{max(got):.2f}x" if got else "-")
            lines.append(f"| {c.mode} | range | {' | '.join(cells)} | | | |")
    return "\n".join(lines)
