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
import math
import os
import random
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvmesh.loadgen.bench_serve_config import TINY_MODEL, ServeBenchConfig
from kvmesh.loadgen.bench_serve_flags import add_arguments, config_from_args
from kvmesh.loadgen.compare_targets import Target
from kvmesh.loadgen.serve_metrics import RequestRecord, Summary
from kvmesh.loadgen.serve_report import RunResult, comparison_text, format_summary, rate_text
from kvmesh.loadgen.server_breakdown import ServerBreakdown
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
    _write_outputs(config, prompts, results)
    if config.slo_base is not None:
        _slo_sweep(config, results)
    return 1 if any(r.summary.num_completed == 0 for r in results) else 0


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


def build_workload(config: ServeBenchConfig) -> tuple[list[WorkloadPrompt], list[float] | None]:
    """The prompts (same for every target) and, for a trace, its arrival times."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
    return _prompts(config, model_config, tokenizer, random.Random(f"{config.seed}:prompts"))


def rate_prompts(
    config: ServeBenchConfig, first: Sequence[WorkloadPrompt]
) -> list[Sequence[WorkloadPrompt]]:
    """Each rate's prompts: the first rate sends ``first``; every later rate of a sweep the same
    lengths (and output lengths) in the same order, with other text (drawn from a seed of the
    rate's index), so that no server answers a later rate from the prefix cache the earlier ones
    filled. A trace or a dataset sends the same prompts at every rate, as before."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    rates = config.request_rates
    if len(rates) < 2 or config.trace is not None or config.dataset is not None:
        return [first] * len(rates)
    model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
    out: list[Sequence[WorkloadPrompt]] = [first]
    for index in range(1, len(rates)):
        lengths_rng = random.Random(f"{config.seed}:prompts")
        text_rng = random.Random(f"{config.seed}:prompts:rate{index}")
        prompts, _ = _prompts(config, model_config, tokenizer, lengths_rng, text_rng)
        out.append(prompts)
    return out


def build_warmups(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], is_trace: bool
) -> list[WorkloadPrompt]:
    """``--warmups`` untimed prompts of at most 8 output tokens: drawn like the workload's, from a
    seed of their own (so no measured prompt is cached by them), or for a trace or a dataset the
    first prompt, as before."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    if not config.num_warmups:
        return []
    if is_trace or config.dataset is not None:
        drawn = [prompts[0]] * config.num_warmups
    else:
        model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
        rng = random.Random(f"{config.seed}:warmups")
        warm = dataclasses.replace(config, num_prompts=config.num_warmups)
        drawn, _ = _prompts(warm, model_config, tokenizer, rng)
    return [dataclasses.replace(p, output_len=min(p.output_len, 8)) for p in drawn]


def _prompts(
    config: ServeBenchConfig,
    model_config: Any,
    tokenizer: Any,
    rng: random.Random,
    text_rng: random.Random | None = None,
) -> tuple[list[WorkloadPrompt], list[float] | None]:
    """Prompt lengths from ``rng``, their text (or token ids) from ``text_rng`` where given, else
    from ``rng`` as it stands after the lengths."""
    from kvmesh.loadgen import arrivals, workload
    from kvmesh.loadgen.corpus import DEFAULT_CORPUS, Corpus

    as_text = config.endpoint_path == "/v1/chat/completions" or config.prompt_format == "text"
    if config.trace is not None:
        records = arrivals.load_trace(config.trace)[: config.num_prompts]
        lengths = [(r.input_len, r.output_len) for r in records]
        prompts = workload.random_prompts(tokenizer, lengths, rng, as_text=as_text)
        return prompts, arrivals.trace_arrival_times(records)
    num = config.num_prompts or 100
    if config.dataset is not None:
        pairs = workload.load_sharegpt(config.dataset)
        return workload.sharegpt_prompts(
            tokenizer, pairs, num, rng, output_len=config.output_len
        ), None
    output_lens = workload.LengthSpec.parse(config.output_len or 64, config.output_len_range)
    input_lens = config.input_lengths().fit_context(
        model_config.max_position_embeddings, output_lens.high
    )
    lengths = workload.sample_lengths(
        num,
        input_lens,
        output_lens,
        rng,
        long_input_len=config.long_input_len,
        long_fraction=config.long_fraction,
    )
    text_rng = rng if text_rng is None else text_rng
    if config.prompt_source == "corpus":
        corpus = Corpus.load(tokenizer, config.corpus or DEFAULT_CORPUS)
        return corpus.prompts(tokenizer, lengths, text_rng), None
    return workload.random_prompts(tokenizer, lengths, text_rng, as_text=as_text), None


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


def served_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str:
    """The model ``base_url`` serves: the first of its ``/v1/models``; ValueError saying what
    went wrong otherwise (the server is down, or lists none)."""
    import urllib.error
    import urllib.request

    import orjson

    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            models = orjson.loads(resp.read())["data"]
        return str(models[0]["id"])
    except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(
            f"could not ask {base_url}/v1/models which model it serves ({exc}); is the server "
            "up? Or name it with --model"
        ) from None


def scrape_metrics(
    base_url: str, api_key: str | None = None, timeout_s: float = 5.0
) -> dict[str, float] | None:
    """The server's ``/metrics`` samples, or None when it has none (not every server does)."""
    from kvmesh.loadgen import prom_text

    try:
        return prom_text.scrape(f"{base_url.rstrip('/')}/metrics", api_key, timeout_s)
    except (OSError, ValueError):
        return None


def fetch_timings(
    base_url: str, api_key: str | None = None, timeout_s: float = 10.0
) -> list[dict[str, Any]] | None:
    """A kvmesh router's latest per-request timings (``GET /v1/kvmesh/timings``), or None from
    a server without them."""
    import urllib.error
    import urllib.request

    import orjson

    request = urllib.request.Request(f"{base_url.rstrip('/')}/v1/kvmesh/timings")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = orjson.loads(resp.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    requests = body.get("requests") if isinstance(body, dict) else None
    return requests if isinstance(requests, list) else None


async def _warmup(endpoint: SseEndpoint, prompt: WorkloadPrompt, timeout_s: float) -> RequestRecord:
    import time

    import aiohttp
    from kvmesh.loadgen.sse_client import send_request

    async with aiohttp.ClientSession() as session:
        return await send_request(
            session, endpoint, prompt, origin=time.perf_counter(), timeout_s=timeout_s
        )


def _write_outputs(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], results: list[RunResult]
) -> None:
    if config.result_json is not None:
        import orjson
        from kvmesh.loadgen.serve_report import result_json

        body = result_json(config.to_json(), results)
        config.result_json.parent.mkdir(parents=True, exist_ok=True)
        config.result_json.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
        print(f"results: {config.result_json}", file=sys.stderr)
    if config.plot_dir is not None:
        for path in _plot(config, prompts, results):
            print(f"plot: {path}", file=sys.stderr)


def _plot(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], results: list[RunResult]
) -> list[Path]:
    from kvmesh.loadgen import plots

    plot_dir = config.plot_dir
    assert plot_dir is not None
    plot_dir.mkdir(parents=True, exist_ok=True)
    long_len = long_prompt_threshold([p.input_len for p in prompts], config.long_input_len)
    rates = list(dict.fromkeys(r.rate for r in results))
    written = []
    for rate in rates:
        runs = {r.label: r.records for r in results if r.rate == rate}
        suffix = f"_rate-{rate_text(rate).removesuffix(' req/s')}" if len(rates) > 1 else ""
        written.append(plots.latency_cdfs(runs, plot_dir / f"latency_cdf{suffix}.png"))
        written.append(plots.token_gaps(runs, plot_dir / f"token_gaps{suffix}.png", long_len))
        breakdowns = {r.label: r.breakdown for r in results if r.rate == rate and r.breakdown}
        if breakdowns:
            written.append(plots.ttft_stages(breakdowns, plot_dir / f"ttft_stages{suffix}.png"))
    if len(rates) > 1:
        sweeps: dict[str, list[tuple[float, Summary]]] = {}
        for r in results:
            if r.rate is not None:  # a trace has no rate, and is never a sweep
                sweeps.setdefault(r.label, []).append((r.rate, r.summary))
        written.append(plots.goodput_vs_rate(sweeps, plot_dir / "goodput_vs_rate.png"))
    return written


def _slo_sweep(config: ServeBenchConfig, results: Sequence[RunResult]) -> None:
    """Print and write (``--slo-dir``) every target's SLO attainment per rate and scale and its
    goodput, also per core."""
    import orjson
    from kvmesh.loadgen import slo_attainment

    assert config.slo_base is not None
    cores = config.cores or len(config.mesh_cpus) or len(os.sched_getaffinity(0))
    runs = {(r.label, r.rate): r.records for r in results if r.rate is not None}
    points, goodputs = slo_attainment.sweep(runs, config.slo_base, config.slo_scales, cores)
    print("\n" + slo_attainment.format_sweep(points, goodputs, config.slo_base, config.slo_scales))
    config.slo_dir.mkdir(parents=True, exist_ok=True)
    path = config.slo_dir / "slo_sweep.json"
    body = slo_attainment.sweep_json(points, goodputs, config.slo_base, config.slo_scales, cores)
    path.write_bytes(orjson.dumps(body, option=orjson.OPT_INDENT_2))
    print(f"SLO sweep: {path}", file=sys.stderr)
    if importlib.util.find_spec("matplotlib") is not None:
        from kvmesh.loadgen import plots

        plot = plots.slo_attainment(points, goodputs, config.slo_dir / "slo_attainment.png")
        print(f"plot: {plot}", file=sys.stderr)


def long_prompt_threshold(input_lens: Sequence[int], long_input_len: int | None) -> int | None:
    """Prompts this long get an arrival line in the gap plot: ``--long-input-len`` when set, else
    twice the median length when some prompt reaches it (a mix of short and long), else none."""
    if long_input_len is not None:
        return long_input_len
    if not input_lens:
        return None
    threshold = math.ceil(2 * statistics.median(input_lens))
    return threshold if max(input_lens) >= threshold else None
