"""``kvmesh bench serve``'s flags and the one validated config they make (no I/O, no heavy imports:
``kvmesh --help`` builds this parser)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvmesh.loadgen.arrivals import ARRIVAL_KINDS, ArrivalProcess, parse_rates
from kvmesh.loadgen.compare_targets import Target, parse_budgets, parse_targets
from kvmesh.loadgen.length_dist import LENGTH_KINDS, LengthDistribution
from kvmesh.loadgen.serve_metrics import Slo
from kvmesh.loadgen.slo_attainment import DEFAULT_SCALES, SloObjective, parse_scales
from kvmesh.loadgen.sse_client import CHAT, COMPLETIONS, SseEndpoint
from kvmesh.loadgen.workload import LengthSpec
from kvmesh.loadgen.workload_presets import PRESETS, apply_preset
from kvmesh.shared.config.cpu_placement import parse_cpu_list

from kvmesh.commands.cpu_plan import SHARINGS

TINY_MODEL = "kvmesh-tiny"
DEFAULT_BUDGETS = "256,512,1024,2048"  # --colocated-budgets: colocated's sweep


@dataclass(frozen=True, slots=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint_path: str = COMPLETIONS
    model: str = TINY_MODEL
    tokenizer: str | None = None  # None: the model's
    api_key: str | None = None
    dataset: Path | None = None  # ShareGPT JSON
    trace: Path | None = None  # JSONL of timestamp, input_len, output_len
    num_prompts: int | None = None  # None: 100, or every record of a trace
    input_len: int = 128  # the mean of a normal or log-normal length
    input_len_range: str | None = None  # normal, log-normal: the clip bounds MIN:MAX
    input_len_dist: Literal["uniform", "normal", "lognormal"] = "uniform"
    input_len_sd: float | None = None
    output_len: int | None = None  # None: 64, or a ShareGPT reply's length
    output_len_range: str | None = None
    long_input_len: int | None = None
    long_fraction: float = 0.0
    prompt_format: Literal["ids", "text"] = "ids"
    prompt_source: Literal["random", "corpus"] = "random"  # random pool tokens or corpus text
    corpus: Path | None = None  # None: the shipped one (loadgen/data)
    workload: str | None = None  # the preset the flags came from (for the record)
    request_rates: tuple[float, ...] = (math.inf,)
    arrival: Literal["poisson", "gamma", "constant"] = "poisson"
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    slo: Slo = field(default_factory=Slo)
    slo_base: SloObjective | None = None  # --slo-sweep's base objective; None: no SLO sweep
    slo_scales: tuple[tuple[str, float], ...] = DEFAULT_SCALES
    slo_dir: Path = Path("slo-sweep")
    cores: int | None = None  # goodput per core divides by this (None: the cores used)
    timeout_s: float = 600.0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    num_warmups: int = 1
    result_json: Path | None = None
    plot_dir: Path | None = None
    compare: tuple[Target, ...] = ()  # given as strings ("colocated", "NAME=URL"): parsed
    transport: Literal["auto", "shm", "tcp", "rdma"] = "auto"
    mesh_env: tuple[tuple[str, str], ...] = ()
    mesh_cpus: frozenset[int] = frozenset()
    local_prefill_threshold: int = 0
    decode_pacing_ms: float = 0.0
    prefill_workers: int | None = None  # disagg meshes of --compare (None: kvmesh up's)
    prefill_nice: int | None = None
    cpu_sharing: str | None = None  # disagg meshes: kvmesh up --cpu-sharing (None: its default)

    def __post_init__(self) -> None:
        if any(isinstance(t, str) for t in self.compare):
            parsed = parse_targets(",".join(t if isinstance(t, str) else "" for t in self.compare))
            if len(parsed) != len(self.compare) or not all(
                isinstance(t, str) for t in self.compare
            ):
                raise ValueError("give --compare's targets all as strings or all as Targets")
            object.__setattr__(self, "compare", parsed)
        positive = (
            "input_len",
            "output_len",
            "num_prompts",
            "max_concurrency",
            "long_input_len",
            "prefill_workers",
        )
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s must be > 0, got {self.timeout_s}")
        if self.num_warmups < 0:
            raise ValueError(f"--warmups must be >= 0, got {self.num_warmups}")
        if self.dataset is not None and self.trace is not None:
            raise ValueError("--dataset and --trace are two workloads; give one")
        self.input_lengths()
        if self.prompt_source not in ("random", "corpus"):
            raise ValueError(f"--prompt-source must be random or corpus, got {self.prompt_source}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"--cores must be >= 1, got {self.cores}")
        LengthSpec.parse(self.output_len or 1, self.output_len_range)
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"--long-fraction must be in [0, 1], got {self.long_fraction}")
        if self.long_fraction and self.long_input_len is None:
            raise ValueError("--long-fraction needs --long-input-len")
        for rate in self.request_rates:
            ArrivalProcess(self.arrival, rate, self.burstiness)
        self.endpoint(self.base_url)
        meshes = [t for t in self.compare if t.mode is not None]
        if meshes and self.model != TINY_MODEL and not Path(self.model).is_dir():
            raise ValueError(
                f"--compare starts local meshes serving --model, which must be {TINY_MODEL} or a "
                f"checkpoint directory (kvmesh model seeded DIR makes one); got {self.model!r}"
            )

    def input_lengths(self) -> LengthDistribution:
        """The prompt-length distribution of the flags (before the model's context cuts it)."""
        return LengthDistribution.parse(
            self.input_len_dist, self.input_len, self.input_len_range, self.input_len_sd
        )

    def endpoint(self, base_url: str) -> SseEndpoint:
        return SseEndpoint(
            base_url=base_url,
            model=self.model,
            path=self.endpoint_path,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            send_ids=self.prompt_format == "ids",
            api_key=self.api_key,
            extra_body=self.extra_body,
        )

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif isinstance(value, Slo | SloObjective):
                value = dataclasses.asdict(value)
            elif f.name == "request_rates":
                value = ["inf" if math.isinf(r) else r for r in value]
            elif f.name == "mesh_cpus":
                value = sorted(value)
            elif f.name == "compare":
                value = [dataclasses.asdict(t) for t in value]
            elif f.name == "api_key" and value:
                value = "<set>"
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        return out


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
        help="the base objective: TTFT, TPOT and each request's p99 token gap, in ms",
    )
    slo.add_argument(
        "--slo-scales",
        default="0.5,1,2",
        help="three multiples of --slo-base: tight, medium, loose (NAME=X names one)",
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
