"""``kvmesh bench serve``'s one validated config (``ServeBenchConfig``: every field checked in
``__post_init__``, written to a result file by ``to_json``); its flags are in
``bench_serve_flags.py``. No I/O, no heavy imports: ``kvmesh --help`` imports it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvmesh.loadgen.arrivals import ArrivalProcess
from kvmesh.loadgen.compare_targets import Target, parse_targets
from kvmesh.loadgen.length_dist import LengthDistribution
from kvmesh.loadgen.serve_metrics import Slo
from kvmesh.loadgen.slo_attainment import DEFAULT_SCALES, SloObjective
from kvmesh.loadgen.sse_client import COMPLETIONS, SseEndpoint
from kvmesh.loadgen.workload import LengthSpec

TINY_MODEL = "kvmesh-tiny"


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
