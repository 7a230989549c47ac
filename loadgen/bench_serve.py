"""``kvmesh bench serve``: open-loop load against any OpenAI-compatible endpoint.

Sends ``--num-prompts`` streamed requests at arrival times from a Poisson, gamma (``--burstiness``)
or constant process at each ``--request-rate`` of a sweep (or from a ``--trace``), with prompts of
exact token lengths made with the served model's tokenizer (or from a ShareGPT ``--dataset``), and
reports TTFT, TPOT, ITL and E2E percentiles, throughputs, goodput under ``--slo`` and every failure
by kind; ``--result-json`` keeps every request's timings, ``--plot-dir`` draws them. Prompts come
from ``--seed`` alone, arrivals from ``--seed`` and the rate: every rate of a sweep sends prompts
of the same lengths in the same (time-scaled) pattern of gaps, each rate with text of its own (no
rate is served from the prefix cache an earlier one filled).

``--compare colocated,disagg,NAME=URL`` runs the identical workload (same seed: same prompts,
same arrivals) against each target in turn and prints them side by side with the ratio of each
to the baseline: ``colocated`` and ``disagg`` are local kvmesh meshes with ``kvmesh up``'s
defaults (on the same ``--mesh-cpus``), colocated swept over ``--colocated-budgets`` and the best
of that sweep under ``--slo`` taken as the baseline; a URL is an OpenAI-compatible server started
elsewhere (e.g. llama.cpp's llama-server). After every run it prints where the first token's
time went: per request, the stages a kvmesh router timed, at p50 and p99; per role, the CPU
time its processes used and the time their threads waited, runnable, for a core (with
``--base-url`` of a local kvmesh mesh, every process of that mesh: ``mesh_processes.py``).

``--workload longtail`` is a named workload (``workload_presets``): prompt lengths drawn from a
clipped normal, text cut from a shipped corpus (``--prompt-source corpus``), gamma arrivals.
``--slo-sweep RATES`` runs every target at each rate and reports DistServe's measure
(``slo_attainment``): the share of requests within a TTFT, TPOT and p99-gap objective at three
scales, and goodput, the highest rate with >= 90% of them, per core too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import os
import random
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.loadgen.bench_serve_config import TINY_MODEL, ServeBenchConfig
from kvmesh.loadgen.bench_serve_flags import add_arguments, config_from_args
from kvmesh.loadgen.compare_targets import Target
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.serve_outputs import slo_sweep, write_outputs
from kvmesh.loadgen.serve_prompts import build_warmups, build_workload, rate_prompts
from kvmesh.loadgen.serve_report import RunResult, comparison_text, format_summary, rate_text
from kvmesh.loadgen.server_breakdown import ServerBreakdown
from kvmesh.loadgen.server_queries import fetch_timings, scrape_metrics, served_model
from kvmesh.loadgen.sse_client import SseEndpoint
from kvmesh.loadgen.workload import WorkloadPrompt


def register_serve(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="open-loop load on an OpenAI-compatible endpoint (TTFT/ITL/goodput; --compare modes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if args.slo_judge is not None:
        return judge_saved(args)
    try:
        asked = args.model
        if asked is not None and _starts_meshes(args.compare):  # they load it, as up would
            asked = resolve_ref(asked, "--model")
        args.model = asked or TINY_MODEL  # the flags are checked before the server is asked
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvmesh bench serve: {exc}", file=sys.stderr)
        return 2
    if config.plot_dir is not None and importlib.util.find_spec("matplotlib") is None:
        from kvmesh.loadgen.plots import INSTALL_HINT

        print(f"kvmesh bench serve: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if asked is None and not config.compare:
        try:
            served = served_model(config.base_url, config.api_key)
        except ValueError as exc:
            print(f"kvmesh bench serve: {exc}", file=sys.stderr)
            return 2
        config = dataclasses.replace(config, model=served)
    from kvmesh.loadgen.workload import WorkloadError

    try:
        source = "--tokenizer" if config.tokenizer else "the served model"
        tokenizer = resolve_ref(config.tokenizer or config.model, source)
        config = dataclasses.replace(config, tokenizer=tokenizer)
        prompts, trace_times = build_workload(config)
        per_rate = rate_prompts(config, prompts)
        warmups = build_warmups(config, prompts, trace_times is not None)
    except (WorkloadError, ValueError) as exc:
        print(f"kvmesh bench serve: {exc}", file=sys.stderr)
        return 2
    results: list[RunResult] = []
    for target in config.compare or (Target("run", url=config.base_url),):
        with _target(config, target) as (base_url, roles):
            status = _sweep(
                config, target.label, base_url, per_rate, warmups, trace_times, results, roles
            )
            if status:
                return status
    if len(results) > 1:
        print("\n" + comparison_text(results))
    write_outputs(config, prompts, results)
    if config.slo_base is not None:
        slo_sweep(config, results)
    return 1 if any(r.summary.num_completed == 0 for r in results) else 0


def judge_saved(args: argparse.Namespace) -> int:
    """``--slo-judge FILE``: a saved sweep's requests judged under this --slo-base and
    --slo-scales (cores: --cores, else the saved run's)."""
    import orjson
    from kvmesh.loadgen.serve_outputs import saved_runs, write_slo_sweep
    from kvmesh.loadgen.slo_attainment import SloObjective, parse_scales

    try:
        body = orjson.loads(args.slo_judge.read_bytes())
        runs = saved_runs(body)
        base, scales = SloObjective.parse(args.slo_base), parse_scales(args.slo_scales)
        cores = args.cores or body.get("config", {}).get("cores")
        if not cores:
            raise ValueError("the saved run names no core count; give --cores")
    except (OSError, orjson.JSONDecodeError, ValueError) as exc:
        print(f"kvmesh bench serve: --slo-judge {args.slo_judge}: {exc}", file=sys.stderr)
        return 2
    write_slo_sweep(runs, base, scales, int(cores), args.slo_dir)
    return 0


def _starts_meshes(compare: str | None) -> bool:
    from kvmesh.loadgen.compare_targets import parse_targets

    return any(t.mode is not None for t in parse_targets(compare or ""))


def resolve_ref(ref: str, source: str) -> str:
    """What kvmesh loads for ``ref`` (the model a server names, or ``--tokenizer``), resolved as
    ``kvmesh up`` resolves its --model (shared/model/model_ref.py): a fetchable name is its cached
    checkpoint (fetched once), a .gguf file its cached import, a directory itself. ValueError
    naming ``source`` and what to give instead where ``ref`` is none of those."""
    from kvmesh.shared.model.fetch import FetchError
    from kvmesh.shared.model.gguf_file import GGUFError
    from kvmesh.shared.model.model_ref import ModelRefError, resolve_model

    def progress(line: str) -> None:
        print(f"kvmesh bench serve: {line}", file=sys.stderr, flush=True)

    try:
        return resolve_model(ref, progress).path
    except ModelRefError as exc:
        raise ValueError(
            f"{source} {ref!r} is not a model kvmesh can load a tokenizer from ({exc}); give "
            "--tokenizer DIR (a checkpoint directory with the server's tokenizer)"
            if source == "the served model"
            else str(exc).replace("--model", source, 1)
        ) from None
    except (FetchError, GGUFError) as exc:
        raise ValueError(f"{source} {ref!r}: {exc}") from None


@contextlib.contextmanager
def _target(config: ServeBenchConfig, target: Target) -> Iterator[tuple[str, dict[str, list[int]]]]:
    """The base URL to load and the processes behind it by role (for their CPU times): an
    outside server's, found by its port, or a fresh local mesh's of ``target.mode``."""
    roles: dict[str, list[int]] = {"loadgen": [os.getpid()]}
    if target.mode is None:
        assert target.url is not None
        from kvmesh.loadgen.mesh_processes import server_roles

        roles.update(server_roles(target.url))  # a local kvmesh mesh: every role's processes
        yield target.url, roles
        return
    from kvmesh.testing.mesh import local_mesh

    print(f"kvmesh bench serve: starting a {target.label} mesh", file=sys.stderr)
    env = dict(config.mesh_env)
    if target.budget is not None:
        env["KVMESH_MAX_NUM_BATCHED_TOKENS"] = str(target.budget)
    with contextlib.ExitStack() as stack:
        saved = os.sched_getaffinity(0)
        if config.mesh_cpus:
            os.sched_setaffinity(0, config.mesh_cpus)  # the mesh's processes inherit it
        try:
            mesh = stack.enter_context(
                local_mesh(
                    target.mode,
                    config.transport,
                    model=config.model,
                    env=env,
                    local_prefill_threshold=config.local_prefill_threshold,
                    decode_pacing_ms=config.decode_pacing_ms,
                    prefill=config.prefill_workers if target.mode == "disagg" else None,
                    prefill_nice=config.prefill_nice,
                    cpu_sharing=config.cpu_sharing,
                )
            )
        finally:
            os.sched_setaffinity(0, saved)  # the load generator keeps its own CPUs
        for spec, proc in mesh.children.values():
            roles.setdefault(spec.argv[1], []).append(proc.pid)  # serve <role> ...
        if mesh.nats is not None:
            roles["nats"] = [mesh.nats.pid]
        yield mesh.url, roles


def _sweep(
    config: ServeBenchConfig,
    label: str,
    base_url: str,
    per_rate: Sequence[Sequence[WorkloadPrompt]],
    warmups: Sequence[WorkloadPrompt],
    trace_times: list[float] | None,
    results: list[RunResult],
    roles: dict[str, list[int]],
) -> int:
    import asyncio

    from kvmesh.loadgen import proc_sched, ttft_breakdown
    from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times
    from kvmesh.loadgen.progress import ProgressBar
    from kvmesh.loadgen.serve_metrics import summarize
    from kvmesh.loadgen.sse_client import run_requests

    endpoint = config.endpoint(base_url)
    for warmup in warmups:
        record = asyncio.run(_warmup(endpoint, warmup, config.timeout_s))
        if not record.is_ok:
            print(
                f"kvmesh bench serve: the warm-up request to {endpoint.url} failed "
                f"({record.error}: {record.detail}); is the server up and serving "
                f"{config.model!r}?",
                file=sys.stderr,
            )
            return 1
    rates: Sequence[float | None] = (None,) if trace_times is not None else config.request_rates
    for rate, prompts in zip(rates, per_rate, strict=True):
        if rate is None:
            times = trace_times or []
        else:
            process = ArrivalProcess(config.arrival, rate, config.burstiness)
            times = arrival_times(process, len(prompts), random.Random(f"{config.seed}:arrivals"))
        bar = ProgressBar(len(prompts), f"{label} @ {rate_text(rate)}")
        before = scrape_metrics(base_url, config.api_key)
        sched_before = proc_sched.read_roles(roles)
        records, duration_s = asyncio.run(
            run_requests(
                endpoint,
                prompts,
                times,
                timeout_s=config.timeout_s,
                max_concurrency=config.max_concurrency,
                on_record=bar.update,
            )
        )
        bar.close()
        used = proc_sched.role_deltas(sched_before, proc_sched.read_roles(roles))
        after = scrape_metrics(base_url, config.api_key)
        server = None if before is None or after is None else ServerBreakdown.between(before, after)
        timings = fetch_timings(base_url, config.api_key)
        breakdown = ttft_breakdown.build(records, timings, used, duration_s)
        summary = summarize(records, duration_s, config.slo)
        result = RunResult(label, rate, summary, tuple(records), server, breakdown)
        print(format_summary(result))
        if server is not None:
            print(server.line())
        print(ttft_breakdown.format_breakdown(label, breakdown))
        results.append(result)
    return 0


async def _warmup(endpoint: SseEndpoint, prompt: WorkloadPrompt, timeout_s: float) -> RequestRecord:
    import time

    import aiohttp
    from kvmesh.loadgen.sse_client import send_request

    async with aiohttp.ClientSession() as session:
        return await send_request(
            session, endpoint, prompt, origin=time.perf_counter(), timeout_s=timeout_s
        )
