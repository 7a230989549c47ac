"""``kvmesh bench serve``'s flags (``add_arguments``) and their reading into the one validated
``ServeBenchConfig`` (``config_from_args``); no I/O, no heavy imports: ``kvmesh --help`` builds
this parser."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvmesh.loadgen.arrivals import ARRIVAL_KINDS, parse_rates
from kvmesh.loadgen.bench_serve_config import TINY_MODEL, ServeBenchConfig
from kvmesh.loadgen.compare_targets import parse_budgets, parse_targets
from kvmesh.loadgen.length_dist import LENGTH_KINDS
from kvmesh.loadgen.serve_metrics import Slo
from kvmesh.loadgen.slo_attainment import SloObjective, parse_scales
from kvmesh.loadgen.sse_client import CHAT, COMPLETIONS
from kvmesh.loadgen.workload_presets import PRESETS, apply_preset
from kvmesh.shared.config.cpu_placement import parse_cpu_list

from kvmesh.commands.cpu_plan import SHARINGS

DEFAULT_BUDGETS = "256,512,1024,2048"  # --colocated-budgets: colocated's sweep


def parse_cpus(text: str) -> frozenset[int]:
    """``--mesh-cpus``: ``"0-3,8"`` -> {0, 1, 2, 3, 8}; nothing listed: no pinning."""
    if not any(part.strip() for part in text.split(",")):
        return frozenset()
    try:
        return parse_cpu_list(text)
    except ValueError as exc:
        raise ValueError(f"--mesh-cpus: {exc}") from None


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    import orjson

    if args.trace is not None and args.request_rate is not None:
        raise ValueError("--trace replays its own timestamps; leave out --request-rate")
    if args.slo_sweep is not None and (args.request_rate is not None or args.trace is not None):
        raise ValueError(
            "--slo-sweep gives the request rates; leave out --request-rate and --trace"
        )
    apply_preset(args, args.workload)  # fills only the flags left out
    rates = args.slo_sweep if args.slo_sweep is not None else args.request_rate or "inf"
    try:
        extra_body = orjson.loads(args.extra_body) if args.extra_body else {}
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    mesh_env = []
    for item in args.mesh_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--mesh-env {item!r}: expected KEY=VALUE")
        mesh_env.append((key, value))
    return ServeBenchConfig(
        base_url=args.base_url,
        endpoint_path=args.endpoint,
        model=args.model,
        tokenizer=args.tokenizer,
        api_key=args.api_key,
        dataset=args.dataset,
        trace=args.trace,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        input_len_range=args.input_len_range,
        input_len_dist=args.input_len_dist,
        input_len_sd=args.input_len_sd,
        output_len=args.output_len,
        output_len_range=args.output_len_range,
        long_input_len=args.long_input_len,
        long_fraction=args.long_fraction,
        prompt_format=args.prompt_format,
        prompt_source=args.prompt_source,
        corpus=args.corpus,
        workload=args.workload,
        request_rates=parse_rates(rates),
        arrival=args.arrival,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        slo=Slo.parse(args.slo or ""),
        slo_base=SloObjective.parse(args.slo_base) if args.slo_sweep is not None else None,
        slo_scales=parse_scales(args.slo_scales),
        slo_dir=args.slo_dir,
        cores=args.cores,
        timeout_s=args.timeout_s,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        extra_body=extra_body,
        num_warmups=args.warmups,
        result_json=args.result_json,
        plot_dir=args.plot_dir,
        compare=parse_targets(args.compare or "", parse_budgets(args.colocated_budgets or "")),
        transport=args.transport,
        mesh_env=tuple(mesh_env),
        mesh_cpus=parse_cpus(args.mesh_cpus or ""),
        local_prefill_threshold=args.local_prefill_threshold,
        decode_pacing_ms=args.decode_pacing_ms,
        prefill_workers=args.prefill_workers,
        prefill_nice=args.prefill_nice,
        cpu_sharing=args.cpu_sharing,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server to load")
    target.add_argument("--endpoint", choices=(COMPLETIONS, CHAT), help=f"default {COMPLETIONS}")
    target.add_argument(
        "--model",
        default=None,
        help="model name sent in every request (default: the one --base-url's /v1/models "
        f"lists); with --compare, the model the local meshes serve ({TINY_MODEL}, the default, "
        "a fetchable model, a .gguf file or a checkpoint directory, as kvmesh up takes it)",
    )
    target.add_argument(
        "--tokenizer",
        help="what makes the prompts' tokens, resolved as kvmesh up resolves --model: a "
        "fetchable model (from the cache, fetched once), a .gguf file, a checkpoint directory or "
        "kvmesh-tiny (default: the served model)",
    )
    target.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="leave ignore_eos out of the body (servers without it may stop before max_tokens)",
    )
    target.add_argument(
        "--extra-body", help="JSON merged into every body, e.g. '{\"min_tokens\": 128}' for vLLM"
    )
    target.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    target.add_argument(
        "--warmups",
        type=int,
        help="untimed requests first, of the workload's lengths but prompts of their own "
        "(default 1)",
    )

    load = p.add_argument_group("workload")
    load.add_argument(
        "--workload",
        choices=tuple(PRESETS),
        help="a named workload setting the flags below (those given still win): "
        + "; ".join(f"{name}: {preset.description}" for name, preset in PRESETS.items()),
    )
    load.add_argument(
        "--num-prompts", type=int, help="default 100 (a trace: all its records, or the first N)"
    )
    load.add_argument(
        "--input-len", type=int, help="prompt tokens (default 128); normal, lognormal: the mean"
    )
    load.add_argument(
        "--input-len-range",
        help="uniform: R for len*(1-R)..len*(1+R), or MIN:MAX; normal, lognormal: MIN:MAX, the "
        "bounds each draw is clipped to (also to the model's context less the output)",
    )
    load.add_argument(
        "--input-len-dist",
        choices=LENGTH_KINDS,
        help="prompt-length distribution (default uniform)",
    )
    load.add_argument(
        "--input-len-sd", type=float, help="normal, lognormal: standard deviation of the lengths"
    )
    load.add_argument("--output-len", type=int, help="max_tokens (default 64; ShareGPT: reply's)")
    load.add_argument("--output-len-range", help="as --input-len-range, for --output-len")
    load.add_argument("--long-input-len", type=int, help="length of the long prompts mixed in")
    load.add_argument("--long-fraction", type=float, default=0.0, help="share of long prompts")
    load.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        help="/v1/completions prompts as token-id lists or text (default ids; chat always sends "
        "text)",
    )
    load.add_argument(
        "--prompt-source",
        choices=("random", "corpus"),
        help="random tokens (default) or text cut from --corpus to each drawn length",
    )
    load.add_argument(
        "--corpus", type=Path, help="UTF-8 text for --prompt-source corpus (default: shipped)"
    )
    load.add_argument("--dataset", type=Path, help="ShareGPT-format JSON file (local)")
    load.add_argument(
        "--trace", type=Path, help='JSONL of {"timestamp": s, "input_len": n, "output_len": n}'
    )
    load.add_argument("--seed", type=int, default=0, help="same seed: same prompts and arrivals")

    arrivals = p.add_argument_group("arrivals")
    arrivals.add_argument(
        "--request-rate", help="req/s, or a comma list for a sweep; inf: all at once (default)"
    )
    arrivals.add_argument("--arrival", choices=ARRIVAL_KINDS, help="default poisson")
    arrivals.add_argument(
        "--burstiness",
        type=float,
        help="gamma shape (< 1: burstier; default 1: Poisson)",
    )
    arrivals.add_argument("--max-concurrency", type=int, help="cap on requests in flight")

    out = p.add_argument_group("results")
    out.add_argument(
        "--slo", help="goodput objectives, e.g. ttft_ms=500,itl_ms=50,e2e_ms=10000 (itl: TPOT)"
    )
    out.add_argument("--result-json", type=Path, help="write every figure and request here")
    out.add_argument("--plot-dir", type=Path, help="write PNG plots here (needs matplotlib)")

    slo = p.add_argument_group("SLO attainment sweep (DistServe's goodput)")
    slo.add_argument(
        "--slo-sweep",
        help="request rates to sweep, e.g. 0.2,0.4,0.8: per rate and target, the share of "
        "requests within --slo-base at each --slo-scales, and goodput: the highest rate with "
        ">= 90%% of them, also per core",
    )
    slo.add_argument(
        "--slo-base",
        default="ttft_ms=3000,tpot_ms=50,gap_ms=250",
        help="the base objective: TTFT, TPOT and each request's p99 token gap, in ms; a limit "
        "left out is no limit (gap_ms=100 alone judges the token gaps only)",
    )
    slo.add_argument(
        "--slo-scales",
        default="0.5,1,2",
        help="three multiples of --slo-base: tight, medium, loose (NAME=X names one)",
    )
    slo.add_argument(
        "--slo-judge",
        type=Path,
        metavar="RESULT_JSON",
        help="judge a sweep's saved --result-json again under --slo-base/--slo-scales (its "
        "requests as they were measured; nothing is sent)",
    )
    slo.add_argument(
        "--slo-dir",
        type=Path,
        default=Path("slo-sweep"),
        help="where the sweep writes slo_sweep.json and slo_attainment.png",
    )
    slo.add_argument(
        "--cores",
        type=int,
        help="goodput per core divides by this (default: --mesh-cpus, else the CPUs this "
        "process may use)",
    )

    mesh = p.add_argument_group("compare (local meshes instead of --base-url)")
    mesh.add_argument(
        "--compare",
        help="targets to run in turn: mesh modes (colocated, disagg: local meshes with kvmesh "
        "up's defaults) and OpenAI-compatible servers not started here (URL or NAME=URL), e.g. "
        "colocated,disagg,llama-server=http://127.0.0.1:8080",
    )
    mesh.add_argument(
        "--colocated-budgets",
        default=DEFAULT_BUDGETS,
        help="colocated's per-step token budgets to sweep (--max-num-batched-tokens); the "
        "comparison takes the best under --slo as its baseline ('': the worker's default only)",
    )
    mesh.add_argument("--transport", default="auto", choices=("auto", "shm", "tcp", "rdma"))
    mesh.add_argument(
        "--mesh-env", action="append", default=[], help="KEY=VALUE for every mesh service"
    )
    mesh.add_argument("--mesh-cpus", help="pin the meshes to these CPUs, e.g. 0-7")
    mesh.add_argument(
        "--local-prefill-threshold",
        type=int,
        default=0,
        help="disagg: prompts shorter than this prefill on the decode worker",
    )
    mesh.add_argument(
        "--decode-pacing-ms",
        type=float,
        default=0.0,
        help="disagg: decode steps start at most this often (kvmesh up --decode-pacing-ms)",
    )
    mesh.add_argument(
        "--prefill-workers",
        type=int,
        help="disagg: prefill workers, sharing the cores (kvmesh up --prefill; default: its)",
    )
    mesh.add_argument(
        "--cpu-sharing",
        choices=SHARINGS,
        help="disagg: how prefill and decode share the cores (kvmesh up --cpu-sharing; "
        "default: its)",
    )
    mesh.add_argument(
        "--prefill-nice",
        type=int,
        help="disagg: prefill workers' niceness (kvmesh up --prefill-nice; default: its)",
    )
