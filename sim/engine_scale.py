"""How much slower the engine runs inside a mesh worker than in calibration's process (pure;
``calibrate.py`` measures and calls it).

Calibration times the engine in its own process. On the idle 2-core box, the same engine inside
the mesh's worker processes took 1.5-2x as long per step and per prefill chunk (docs/sim.md),
which left the simulator's TTFT 0.65-0.75x of the real mesh's. So during the calibration probe
(``probe.py``: its workload, never the validation's) the mesh's own ``/metrics`` are read before
and after, and their engine means (``engine_timings.EngineTimings``: a decode or colocated
worker's step, a prefill worker's chunk) are set against the simulator's for the same probe:

- ``colocated``: the colocated mesh's mean step over the isolated and batch phases (decode
  steps, but for eight 64-token prefills), real / simulated;
- ``colocated_chunk``: its mean step over the long prompts' phase (1,024-token prompts in
  512-token chunks: the chunks' time, mostly);
- ``decode``: the disagg mesh's decode worker's mean step over the isolated and batch phases
  (64-192 tokens of context);
- ``decode_long``: its mean step over the long prompts' phase (1,024 tokens of context);
- ``prefill``: the disagg mesh's prefill worker's mean chunk over the whole probe.

The fit is an ``EngineScale`` (``specs.py``; a device spec's ``engine``). The prefill role's
engine costs (its ``prefill``; ``CostModel.step(slices, role)``) are multiplied by a scale. A
disagg decode step is ``decode`` times its engine costs plus ``decode_extra_s``, fitted to its two figures as the colocated pair
below (one factor fitted to the short contexts' steps charged the validation's 1,000-token
contexts' KV reads x1.4-2.7: disagg ITL p50 1.37x in one run). A colocated step is
``colocated`` times its engine costs plus ``colocated_extra_s``: its decode
steps came out 4-5x the in-process engine's and its chunks 1.5x (2.80 against 0.62 ms, 22.8
against 13.4 ms in one calibration), so one factor fitted to the decode steps overcharged the
validation's decode steps over 1,000-token contexts 1.5-2.9x (their KV reads times 5), and one
per kind of step (the model before) could not say what a step of both costs. A fixed stall per
step (its two OpenMP threads waiting for one that the router or NATS preempted) and a factor on
the rest fit both (those means solve to ``x1.57 + 1.8 ms``). The two are fitted to the two colocated figures
together (Newton steps on a numeric Jacobian); where the fit wants a negative stall, the stall
is 0 and the factor the relative least-squares fit to both.

The simulated means move with the scales not quite in proportion (workers share cores), so the
fit is iterated for ``ROUNDS`` rounds: for decode and prefill first ``scale <- scale * real /
simulated``, then secant steps (the phases mix the roles). A role the probe did not measure
keeps 1 (and no stall).

With several probe runs (``kvmesh sim --calibrate --probe-runs N``) the fit is made once, to
each phase mean's median over the runs (``median_phases``): one run disturbed by something else
on the machine moves the median less than it moves a pooled mean.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.engine_timings import EngineTimings, pooled
from kvmesh.sim.probe import long_requests, probe_requests
from kvmesh.sim.specs import EngineScale
from kvmesh.sim.topology import Topology

ROUNDS = 10
ROLES = ("colocated", "colocated_chunk", "decode", "decode_long", "prefill")  # the figures
SCALED = ("prefill",)  # the roles fitted by one factor each
# the roles fitted by a factor and a stall: (the mode, the short phases' figure, the long one's)
STALLED = {
    "colocated": ("colocated", "colocated", "colocated_chunk"),
    "decode": ("disagg", "decode", "decode_long"),
}


@dataclass(frozen=True, slots=True)
class PhaseTimings:
    """A mode's engine means over the probe's isolated and batch phases (``short``) and over
    its long prompts (``long``)."""

    short: EngineTimings
    long: EngineTimings


@dataclass(frozen=True, slots=True)
class ScaleFigure:
    """One role's engine mean during the probe: the mesh's, and the simulator's without the
    scale (``unscaled_s``) and with it (``scaled_s``), over ``count`` real steps or chunks."""

    role: str
    measured_s: float
    unscaled_s: float
    scaled_s: float
    count: int

    @property
    def relative(self) -> float:
        return self.scaled_s / self.measured_s - 1


@dataclass(frozen=True, slots=True)
class EngineScaleFit:
    scale: EngineScale
    figures: tuple[ScaleFigure, ...]

    def describe(self) -> str:
        """The provenance line calibration stores in the spec's description."""
        terms = ", ".join(f"{name} {value}" for name, value in self.scale.terms())
        means = ", ".join(
            f"{f.role} {f.measured_s * 1e3:.2f} ms mean over {f.count} (in-process model "
            f"{f.unscaled_s * 1e3:.2f} ms)"
            for f in self.figures
        )
        return f"mesh engine scale (probe's /metrics): {terms}; {means}"


def median_timings(parts: Sequence[EngineTimings]) -> EngineTimings:
    """Several probe runs' engine means over one phase as one: each mean the median over the runs
    that measured it (a run with a count of 0 has none), the counts added."""

    def median(count: str, value: str) -> tuple[int, float | None]:
        got = [p for p in parts if getattr(p, count) > 0 and getattr(p, value) is not None]
        n = sum(getattr(p, count) for p in got)
        return n, (statistics.median(getattr(p, value) for p in got) if got else None)

    steps, step = median("home_steps", "home_step_s")
    chunks, chunk = median("prefill_chunks", "prefill_chunk_s")
    jobs, queue = median("prefill_jobs", "prefill_queue_s")
    return EngineTimings(steps, step, chunks, chunk, jobs, queue)


def median_phases(runs: Sequence[PhaseTimings]) -> PhaseTimings:
    """Several probe runs' phase timings of one mode as one (``median_timings`` per phase)."""
    if not runs:
        raise ValueError("no probe runs")
    return PhaseTimings(
        median_timings([r.short for r in runs]), median_timings([r.long for r in runs])
    )


def simulate_probe_timings(
    mode: str, cost: CostModel, topology_for: Callable[[str, CostModel], Topology]
) -> PhaseTimings:
    """The engine means of the probe's phases (isolated and batch; long) on ``mode``'s
    simulated twin."""
    isolated, batch = probe_requests()
    topology = topology_for(mode, cost)

    def run(requests: list) -> EngineTimings:
        timings = simulate(topology, cost, requests, wake=False).timings
        assert timings is not None
        return timings

    return PhaseTimings(pooled([run(isolated), run(batch)]), run(long_requests()))


def role_means(mode: str, t: PhaseTimings) -> dict[str, tuple[float, int]]:
    """The roles' engine means (seconds, count) a mode's phase timings hold."""
    out = {}

    def put(role: str, mean: float | None, count: int) -> None:
        if mean is not None and count > 0:
            out[role] = (mean, count)

    if mode == "colocated":
        put("colocated", t.short.home_step_s, t.short.home_steps)
        put("colocated_chunk", t.long.home_step_s, t.long.home_steps)
    elif mode == "disagg":
        put("decode", t.short.home_step_s, t.short.home_steps)
        put("decode_long", t.long.home_step_s, t.long.home_steps)
        chunks = pooled([t.short, t.long])
        put("prefill", chunks.prefill_chunk_s, chunks.prefill_chunks)
    return out


def fit_engine_scale(
    cost: CostModel,
    measured: Mapping[str, PhaseTimings],
    simulate_timings: Callable[[str, CostModel], PhaseTimings],
    rounds: int = ROUNDS,
    jitter_mean_s: Mapping[str, float] | None = None,
) -> EngineScaleFit:
    """The scales (and the colocated stall) with which the simulated probe's engine means
    (``simulate_timings(mode, cost)``) match ``measured`` (the mesh's, by mode: ``colocated``,
    ``disagg``). ``cost`` is the in-process engine's (its scales are ignored: the fit starts
    from 1 and no stall). A real loop step's time holds its jitter, which the simulator adds to
    a loop step apart: ``jitter_mean_s[role]`` (``colocated``, ``decode``) is taken off that
    role's means before they are matched."""
    jitter = jitter_mean_s or {}
    real = {
        role: value for mode, t in measured.items() for role, value in role_means(mode, t).items()
    }
    real = {
        role: (_less_jitter(mean, jitter.get(_loop_role(role), 0.0), role), count)
        for role, (mean, count) in real.items()
    }
    modes = [m for m in measured if role_means(m, measured[m])]

    def simulated(scale: EngineScale, only: Sequence[str] | None = None) -> dict[str, float]:
        trial = CostModel(cost.model, scale.apply(cost.device), cost.tp)
        out = {}
        for mode in modes if only is None else [m for m in modes if m in only]:
            for role, (mean, _) in role_means(mode, simulate_timings(mode, trial)).items():
                out[role] = mean
        return out

    scale = EngineScale()
    unscaled = simulated(scale)
    sim, previous = unscaled, {}
    for _ in range(rounds):
        factors = {}
        for role in SCALED:
            if role not in real or not sim.get(role):
                continue
            s, target = getattr(scale, role), real[role][0]
            s_prev, sim_prev = previous.get(role, (None, None))
            if s_prev is not None and abs(sim[role] - sim_prev) > 1e-12 * target:
                # secant: a role's mean is about affine in its scale (the phase mixes roles)
                step = (target - sim[role]) * (s - s_prev) / (sim[role] - sim_prev)
                factors[role] = max(s + step, s / 4)
            else:
                factors[role] = s * target / sim[role]
            previous[role] = (s, sim[role])
        for role, (mode, short, long) in STALLED.items():
            if short in real and sim.get(short):
                factor, extra = _stalled_step(
                    scale, role, mode, (short, long), sim, real, simulated
                )
                factors.update({role: factor, f"{role}_extra_s": extra})
        scale = dataclasses.replace(scale, **factors)
        sim = simulated(scale)
    figures = tuple(
        ScaleFigure(role, real[role][0], unscaled[role], sim[role], real[role][1])
        for role in ROLES
        if role in real and role in unscaled
    )
    return EngineScaleFit(scale, figures)


def _loop_role(role: str) -> str:
    """Whose jitter a figure's mean holds: the colocated worker's (both its figures) or the
    decode worker's (both its figures; the prefill worker runs no loop steps)."""
    return role.split("_")[0]


def _less_jitter(mean: float, jitter_mean_s: float, role: str) -> float:
    return mean if role == "prefill" else max(mean - jitter_mean_s, mean / 4)


def _stalled_step(
    scale: EngineScale,
    role: str,
    mode: str,
    keys: tuple[str, str],
    sim: Mapping[str, float],
    real: Mapping[str, tuple[float, int]],
    simulated: Callable[[EngineScale, Sequence[str]], dict[str, float]],
) -> tuple[float, float]:
    """One step of a role's (factor, stall) fit: a Newton step on a numeric Jacobian when the
    probe has both its figures (``keys``: the short phases' mean step and the long prompts'),
    else a factor alone (a ratio step). A solution with a negative stall, or a factor below a
    quarter of the last, is refused for the factor that best fits both figures relatively with
    no stall."""
    stall = f"{role}_extra_s"
    s, a = getattr(scale, role), getattr(scale, stall)
    short, long = keys
    if long not in real or not sim.get(long):
        return s * real[short][0] / sim[short], 0.0
    targets = [real[k][0] for k in keys]
    here = [sim[k] for k in keys]
    ds, da = 0.05 * s, max(1e-4, 0.05 * a)
    by_s = simulated(dataclasses.replace(scale, **{role: s + ds}), [mode])
    by_a = simulated(dataclasses.replace(scale, **{stall: a + da}), [mode])
    j = [[(by_s[k] - h) / ds, (by_a[k] - h) / da] for k, h in zip(keys, here, strict=True)]
    det = j[0][0] * j[1][1] - j[0][1] * j[1][0]
    miss = [t - h for t, h in zip(targets, here, strict=True)]
    if abs(det) > 1e-15:
        new_s = s + (miss[0] * j[1][1] - miss[1] * j[0][1]) / det
        new_a = a + (j[0][0] * miss[1] - j[1][0] * miss[0]) / det
        if new_a >= 0 and new_s >= s / 4:
            return new_s, new_a
    # no stall: the factor that best fits both figures relatively, from their means at no stall
    base = simulated(dataclasses.replace(scale, **{stall: 0.0}), [mode])
    r = [base[k] / t for k, t in zip(keys, targets, strict=True)]
    return max(s * sum(r) / sum(x * x for x in r), s / 4), 0.0
