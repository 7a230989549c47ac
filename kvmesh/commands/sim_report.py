"""What ``kvmesh sim`` prints (``kvmesh/commands/sim.py`` parses the arguments and runs the
subcommands): the assumptions line of a simulation, the calibration's fits and mesh probe, and
the validation's fits on its own meshes, disturbed repeats and per-request tables.

The simulator's modules are imported for type checking only, or inside a function: this module
is imported with the ``kvmesh`` parser, which must not import torch."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.sim.calibrate import Calibration
    from kvmesh.sim.cost import CostModel
    from kvmesh.sim.engine_scale import EngineScale, EngineScaleFit
    from kvmesh.sim.mesh_terms import MeshOverheads
    from kvmesh.sim.overheads import OverheadFit
    from kvmesh.sim.probe_fit import ProbeRun
    from kvmesh.sim.sla import Sla
    from kvmesh.sim.specs import DeviceSpec, ModelSpec
    from kvmesh.sim.validate import Comparison, RunFit, Served
    from kvmesh.sim.workload import SimRequest


def assumptions(cost: CostModel, requests: Sequence[SimRequest], sla: Sla) -> str:
    d, m = cost.device, cost.model
    n_in = [r.input_len for r in requests]
    return (
        f"{m.name} ({m.weight_bytes / 1e9:.1f} GB weights, {m.kv_bytes_per_token / 1024:.0f} KiB KV "
        f"per token) on {d.name} x tp {cost.tp}: {d.peak_flops / 1e12:.0f} TFLOP/s x "
        f"{d.flops_efficiency:g}, {d.mem_bandwidth / 1e12:.2f} TB/s x {d.bandwidth_efficiency:g}, "
        f"{d.step_overhead_s * 1e3:g} ms per step, {d.cache_bytes / 1e6:g} MB cache, link {d.link_bandwidth / 1e9:g} GB/s; "
        f"{len(requests)} requests, prompts {min(n_in)}-{max(n_in)} tokens; "
        f"SLA p99 TTFT <= {sla.ttft_ms:g} ms, p99 ITL <= {sla.itl_ms:g} ms"
    )


# --- --calibrate ------------------------------------------------------------------------------


def print_calibration(result: Calibration, model: ModelSpec) -> None:
    """The engine fit's residuals and figures, then (with a mesh probe) each probe run, the
    engine scale in the mesh and the mesh overheads fitted."""
    s, fit = result.spec, result.fit
    print(f"measured in {result.seconds:.0f} s on {s.cores} cores, {s.calibration_threads} threads")
    rows = [(r.label, r.measured_s, r.predicted_s, r.relative) for r in fit.residuals]
    print_residuals("point", "fitted", rows, fit.notes)
    if fit.max_relative_error > 0.25:
        print(
            f"warning: a point is off by {fit.max_relative_error:.0%}: the cost model does not "
            "describe this machine well at that shape (or the machine was busy)"
        )
    cache = "in" if s.cache_bytes >= model.weight_bytes else "out of"
    print(
        f"effective {s.peak_flops / 1e9:.1f} GFLOP/s, {s.mem_bandwidth / 1e9:.2f} GB/s; overhead "
        f"{s.step_overhead_s * 1e3:.2f} ms per step + {s.seq_overhead_s * 1e3:.3f} ms per "
        f"sequence + {s.chunk_overhead_s * 1e3:.2f} ms per prefill chunk; "
        f"{s.cache_bytes / 2**20:.0f} MiB LLC ({model.name}'s weights {cache} it); "
        f"link {s.link_bandwidth / 1e9:.1f} GB/s"
    )
    if result.probe_runs:
        print_probe_runs(result.probe_runs)
    if result.engine_scale is not None:
        print_engine_scale(result.engine_scale)
    elif result.mesh is not None:
        print("\nmesh engine scale: not measured (the mesh's /metrics could not be read); 1")
    if result.mesh is not None:
        print_mesh_fit(result.mesh)


def print_residuals(
    what: str,
    model: str,
    rows: Sequence[tuple[str, float, float, float]],
    notes: Sequence[str],
) -> None:
    """A table of (label, measured seconds, the ``model``'s seconds, relative residual) rows, a
    ``what`` each, in ms; then the fit's notes."""
    print(f"| {what} | measured ms | {model} ms | residual |\n|---|---|---|---|")
    for label, measured_s, model_s, relative in rows:
        print(f"| {label} | {measured_s * 1e3:.2f} | {model_s * 1e3:.2f} | {relative:+.1%} |")
    for note in notes:
        print(f"note: {note}")


def print_probe_runs(runs: Sequence[ProbeRun]) -> None:
    """Each probe run's figures and the scale and overheads fitted to it alone: the spread that
    the fit to the medians (below) smooths."""
    from kvmesh.sim.engine_scale import role_means

    n = len(runs)
    print(f"\nmesh probe, {n} runs (the fit below is to each figure's median over them):")
    print(
        "| run | mode | TTFT ms | gap batch 1 ms | gap batch 8 ms | long-prompt TTFT ms | "
        "engine mean ms (count) |\n|---|---|---|---|---|---|---|"
    )
    for k, r in enumerate(runs, 1):
        for mode, f in r.figures.items():
            means = role_means(mode, r.timings[mode]) if mode in r.timings else {}
            engine = ", ".join(f"{role} {m * 1e3:.2f} ({c})" for role, (m, c) in means.items())
            long = r.long_ttft_s.get(mode)
            print(
                f"| {k} | {mode} | {f.ttft_s * 1e3:.1f} | {f.gap_1_s * 1e3:.2f} | "
                f"{f.gap_batch_s * 1e3:.2f} | {'-' if long is None else f'{long * 1e3:.0f}'} | "
                f"{engine or '-'} |"
            )
    print("\neach run fitted alone (not used; the spec gets the fit to the medians):")
    print(fit_header())
    for k, r in enumerate(runs, 1):
        assert r.overheads is not None, "calibration fits every probe run alone"
        print(f"| {k} | {' | '.join(fit_cells(r.scale, r.overheads))} |")
    print_scale_spread([r.scale for r in runs])


FIT_COLUMNS = (
    "engine scale",
    "colocated loop + token ms",
    "decode loop + token ms",
    "request ms",
    "hand-off ms",
    "wake ms (colocated; prefill)",
    "warm-up ms (colocated; decode)",
    "jitter p90 / p99 ms (colocated; decode)",
    "pace p10-p90 (colocated; decode)",
)


def fit_header(extra: tuple[str, ...] = ()) -> str:
    """The header of a table with one fitted scale and overheads a row (``fit_cells``)."""
    header = ["run", *FIT_COLUMNS, *extra]
    return "| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|"


def scale_terms(scale: EngineScale) -> list[tuple[str, float, str]]:
    """A fitted engine scale's terms as (name, value, text): a factor per role (``x1.57``), a
    fixed term (a field in seconds, ``_s``) in ms."""
    out = []
    for field in dataclasses.fields(scale):
        value = getattr(scale, field.name)
        if field.name.endswith("_s"):
            out.append((field.name.removesuffix("_s"), value * 1e3, f"{value * 1e3:.2f} ms"))
        else:
            out.append((field.name, value, f"x{value:.2f}"))
    return out


def fit_cells(scale: EngineScale | None, o: MeshOverheads) -> list[str]:
    """One fit's engine scale ("-": none fitted) and overheads, as table cells."""
    scales = "-" if scale is None else ", ".join(f"{n} {t}" for n, _, t in scale_terms(scale))
    return [
        scales,
        f"{o.colocated_loop_s * 1e3:.2f} + {o.colocated_token_s * 1e3:.3f}",
        f"{o.loop_s * 1e3:.2f} + {o.token_s * 1e3:.3f}",
        f"{o.request_s * 1e3:.1f}",
        f"{o.handoff_s * 1e3:.1f}",
        f"{o.colocated_wake_s * 1e3:.1f}; {o.prefill_wake_s * 1e3:.1f}",
        f"{o.colocated_warmup_s * 1e3:.2f}; {o.decode_warmup_s * 1e3:.2f}",
        "; ".join(
            f"{j.p90_s * 1e3:.2f} / {j.p99_s * 1e3:.2f}" for j in (o.colocated_jitter, o.jitter)
        ),
        "; ".join(f"{j.pace[1]:.2f}-{j.pace[3]:.2f}" for j in (o.colocated_jitter, o.jitter)),
    ]


def print_scale_spread(scales: Sequence[EngineScale | None]) -> None:
    """Each engine scale term's range over the runs that fitted one (two or more)."""
    fitted = [scale_terms(s) for s in scales if s is not None]
    if len(fitted) > 1:
        spread = ", ".join(
            f"{name} {min(t[k][1] for t in fitted):.2f}-{max(t[k][1] for t in fitted):.2f}"
            + (" ms" if unit.endswith("ms") else "x")
            for k, (name, _, unit) in enumerate(fitted[0])
        )
        print(f"the scales fitted run by run: {spread}")


def print_engine_scale(scaled: EngineScaleFit) -> None:
    print("\nengine in the mesh's workers during the probe (their /metrics) against the model:")
    print(
        "| figure | mesh mean ms | count | in-process model ms | scaled model ms |\n"
        "|---|---|---|---|---|"
    )
    for f in scaled.figures:
        print(
            f"| {f.role} | {f.measured_s * 1e3:.2f} | {f.count} | {f.unscaled_s * 1e3:.2f} | "
            f"{f.scaled_s * 1e3:.2f} ({f.relative:+.1%}) |"
        )
    print("engine in the mesh: " + ", ".join(f"{n} {v}" for n, v in scaled.scale.terms()))


def print_mesh_fit(mesh: OverheadFit) -> None:
    from kvmesh.sim.cost import WARMUP_STEPS

    o = mesh.overheads
    print("\nmesh probe (simulated with the overheads below):")
    rows = [(r.label, r.measured_s, r.simulated_s, r.relative) for r in mesh.residuals]
    rows += [(f"check: {r.label}", r.measured_s, r.simulated_s, r.relative) for r in mesh.checks]
    print_residuals("figure", "simulated", rows, mesh.notes)
    if mesh.max_check_error > 0.25:
        print(
            f"warning: a long prompt's TTFT is off by {mesh.max_check_error:.0%} though nothing "
            "was fitted to it: the engine's calibrated prefill, or the request path, is not what "
            "the mesh shows at that length (or the machine was busy)"
        )
    if mesh.max_relative_error > 0.25:
        print(
            f"warning: a probe figure is off by {mesh.max_relative_error:.0%}: the overheads do "
            "not describe this mesh well (or the machine was busy)"
        )
    print(
        f"mesh overheads: colocated loop {o.colocated_loop_s * 1e3:.2f} ms per step + "
        f"{o.colocated_token_s * 1e3:.3f} ms per streamed token; "
        f"decode loop {o.loop_s * 1e3:.2f} ms per step + {o.token_s * 1e3:.3f} ms per "
        f"streamed token; request {o.request_s * 1e3:.1f} ms; disagg hand-off "
        f"{o.handoff_s * 1e3:.1f} ms; the first step after idling: colocated "
        f"+{o.colocated_wake_s * 1e3:.1f} ms, prefill +{o.prefill_wake_s * 1e3:.1f} ms; "
        f"a sequence's first decode step: colocated +{o.colocated_warmup_s * 1e3:.2f} ms, "
        f"decode +{o.decode_warmup_s * 1e3:.2f} ms (tapering over {WARMUP_STEPS} steps); "
        "loop step jitter over its request's median (p90, p99, max): "
        + "; ".join(
            f"{who} {j.p90_s * 1e3:.2f}, {j.p99_s * 1e3:.2f}, {j.max_s * 1e3:.1f} ms"
            for who, j in (("colocated", o.colocated_jitter), ("decode", o.jitter))
        )
        + "; each sequence's pace against the mean (min, p10, p50, p90, max): "
        + "; ".join(
            f"{who} " + ", ".join(f"{x:.2f}" for x in j.pace)
            for who, j in (("colocated", o.colocated_jitter), ("decode", o.jitter))
        )
    )


# --- --validate -------------------------------------------------------------------------------


def print_engine_figures(d: DeviceSpec) -> None:
    """``--probe-each-run``: the spec's engine figures, all it takes from the spec."""
    print(
        f"simulated on {d.name}'s engine figures: {d.peak_flops / 1e9:.1f} GFLOP/s, "
        f"{d.mem_bandwidth / 1e9:.2f} GB/s, {d.step_overhead_s * 1e3:.2f} ms per step; the "
        "engine scale and mesh overheads fitted to the probes served on the validation's "
        "own meshes, before and after each workload"
    )


def print_spec_terms(d: DeviceSpec) -> None:
    """The spec's engine figures, mesh overheads and engine scales the simulation uses."""
    m = d.mesh
    print(
        f"simulated on {d.name}: {d.peak_flops / 1e9:.1f} GFLOP/s, {d.mem_bandwidth / 1e9:.2f} GB/s, "
        f"{d.step_overhead_s * 1e3:.2f} ms per step; mesh overheads: colocated loop "
        f"{m.colocated_loop_s * 1e3:.2f} ms + {m.colocated_token_s * 1e3:.3f} ms "
        f"per token, decode loop {m.loop_s * 1e3:.2f} ms + "
        f"{m.token_s * 1e3:.3f} ms per token, request "
        f"{m.request_s * 1e3:.1f} ms, hand-off {m.handoff_s * 1e3:.1f} ms, "
        f"wake colocated {m.colocated_wake_s * 1e3:.1f} ms, prefill "
        f"{m.prefill_wake_s * 1e3:.1f} ms, warm-up colocated "
        f"{m.colocated_warmup_s * 1e3:.2f} ms, decode {m.decode_warmup_s * 1e3:.2f} ms, "
        + ", ".join(
            f"{who} jitter p90 {p90 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {top * 1e3:.1f} ms"
            for who, (p90, p99, top) in (
                ("colocated", d.jitter_knots("colocated")),
                ("decode", d.jitter_knots("decode")),
            )
        )
        + ", "
        + ", ".join(
            f"{who} pace p10-p90 {knots[1]:.2f}-{knots[3]:.2f}"
            for who, knots in (
                ("colocated", d.pace_knots("colocated")),
                ("decode", d.pace_knots("decode")),
            )
        )
        + ("" if m.request_s else " (none measured: run --calibrate first)")
        + "; engine in the mesh "
        + ", ".join(f"{value} {role}" for role, value in d.engine.terms())
    )


def print_disturbed(served: Served) -> None:
    """The repeats served again because the hypervisor disturbed them, and those kept so."""
    for s in served.set_aside:
        print(
            f"repeat {s.repeat + 1} served again: the hypervisor took {s.steal.cell()} of the CPU "
            f"during the {s.mode} mesh's probes / workload (--max-steal {served.max_steal:.0%})"
        )
    for k, mode, steal in served.kept_disturbed():
        print(
            f"warning: repeat {k + 1}'s {mode} run lost {steal.cell()} of the CPU to the "
            "hypervisor and is compared all the same (no --redo left): its machine was not "
            "the one its probes measured"
        )


PROBE_FIT_COLUMNS = ("worst probe residual", "worst long-prompt check")


def print_probe_fit_row(label: str, fit: RunFit, note_prefix: str = "note") -> None:
    """One fit made on validation meshes (``validate.RunFit``) as a row of a ``fit_header``
    table with ``PROBE_FIT_COLUMNS``, then its notes."""
    mesh = fit.mesh
    check = f"{mesh.max_check_error:.0%}" if mesh.checks else "-"
    cells = fit_cells(_scale_of(fit), mesh.overheads)
    print(f"| {label} | {' | '.join([*cells, f'{mesh.max_relative_error:.0%}', check])} |")
    for note in mesh.notes:
        print(f"{note_prefix}: {note}")


def _scale_of(fit: RunFit) -> EngineScale | None:
    """The engine scale of a fit made on validation meshes (None: their /metrics were unread)."""
    return None if fit.engine_scale is None else fit.engine_scale.scale


def print_pooled_fit(fit: RunFit, runs: int) -> None:
    """``--probe-each-run``: the fit to every probe run of the validation (each figure their
    median, the jitter their gaps together), which the pooled comparison below uses."""
    print(
        f"\nthe fit to all {runs} probe runs (each figure their median, the jitter their gaps "
        "together; the comparison below uses it):"
    )
    print(fit_header(PROBE_FIT_COLUMNS))
    print_probe_fit_row("all", fit)


def print_run_fits(fits: Sequence[RunFit]) -> None:
    """``--probe-each-run``: each repeat's scale and overheads, fitted to the two probe runs its
    meshes served (before and after the workload), with the fit's worst probe residual and its
    worst long-prompt check (nothing fitted to those)."""
    print("\neach repeat's fit to the probes on its own meshes (its own simulation uses it):")
    print(fit_header(PROBE_FIT_COLUMNS))
    for k, f in enumerate(fits, 1):
        print_probe_fit_row(str(k), f, f"note (repeat {k})")
    print_scale_spread([_scale_of(f) for f in fits])


def print_per_request(comparisons: Sequence[Comparison]) -> None:
    """``--per-request``: each real run's requests beside their simulated counterparts, then
    each mode's engine means from the mesh's /metrics and from the simulation."""
    from kvmesh.sim.engine_timings import format_timings
    from kvmesh.sim.per_request import format_pairs, pair

    for c in comparisons:
        for k, run in enumerate(c.real_runs):
            label = c.mode if len(c.real_runs) == 1 else f"{c.mode}, run {k + 1}"
            print()
            print(format_pairs(label, pair(run, c.sim_of(k))))
        print(format_timings(c.mode, c.real_timings, c.sim_timings))
