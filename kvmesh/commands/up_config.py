"""``kvmesh up``'s configuration: every flag, its default and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.commands.cpu_plan import Sharing
from kvmesh.commands.up_model import DEFAULT_MODEL
from kvmesh.shared.config.nats_options import NatsClientConfig
from kvmesh.shared.config.service_config import check_at_least, check_positive, option
from kvmesh.shared.config.subjects import mesh_from_model
from kvmesh.shared.config.worker_config import KvCacheDtype, TransportChoice
from kvmesh.shared.obs.logs import LogFormat, LogLevelName

# stop order: earlier tiers first (router stops taking requests before its backends go)
TIERS = ("router", "prefill", "decode", "draft", "kv-store", "kv-registry")

# ``kvmesh up --help``'s groups: the flags by the service they set (every field in one)
FLAG_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "served_model_name")),
    (
        "router (kvmesh serve router)",
        ("port", "host", "routers", "local_prefill_threshold", "tool_call_parser"),
    ),
    (
        "prefill and decode workers (kvmesh serve prefill|decode|colocated)",
        (
            "mode",
            "prefill",
            "prefill_tp",
            "decode",
            "decode_tp",
            "device",
            "transport",
            "kv_cache_bytes",
            "kv_cache_dtype",
            "decode_kv_cache_dtype",
        ),
    ),
    (
        "how prefill and decode share the CPU",
        ("cores", "cpu_sharing", "prefill_nice", "decode_pacing_ms"),
    ),
    (
        "draft workers: speculative decoding (kvmesh serve draft)",
        (
            "draft",
            "draft_workers",
            "num_speculative_tokens",
            "draft_tree",
            "draft_exit_layer",
            "draft_model",
        ),
    ),
    (
        "kv-store: prompt KV beside the workers (kvmesh serve kv-store)",
        ("kv_store", "kv_store_capacity_gb", "kv_store_disk_path", "kv_store_disk_capacity_gb"),
    ),
    (
        "NATS: the control plane (started here if none answers)",
        (
            "nats_url",
            "mesh",
            "nats_creds",
            "nats_tls_ca",
            "nats_tls_cert",
            "nats_tls_key",
            "nats_trust_network",
            "nats_insecure",
        ),
    ),
    (
        "every service: logs, start and stop",
        ("log_level", "log_format", "startup_timeout_s", "max_restarts", "stop_timeout_s"),
    ),
)

EXAMPLES = """\
examples:
  kvmesh up                    # smollm2-135m-instruct, disagg, at http://127.0.0.1:8000/v1
  kvmesh up --model kvmesh-tiny --mode colocated
  kvmesh up --model ~/models/llama.Q4_0.gguf --port 8080 --host 0.0.0.0
  kvmesh up --prefill 2 --decode 2 --cores 8
  kvmesh up --draft ngram --num-speculative-tokens 4
  kvmesh up --kv-store 1 --kv-store-capacity-gb 2
  kvmesh up --tool-call-parser hermes --log-level debug

Every flag can be set by its variable instead (--port 8080: KVMESH_PORT=8080); a flag wins.
"""


@dataclass(frozen=True, slots=True)
class UpConfig(NatsClientConfig):
    """``nats_url`` (inherited): the NATS server; started here if none answers. Left at its
    default, a server there that another ``kvmesh up``'s mesh owns is not joined: this mesh gets
    a nats-server of its own on a free port."""

    model: str = option(
        DEFAULT_MODEL,
        help="a checkpoint directory, a fetchable model (fetched and imported into the cache "
        "once: kvmesh model fetch), a .gguf file (imported into the cache once) or kvmesh-tiny",
    )
    served_model_name: str | None = option(
        None,
        help="the model id clients send (default: the fetchable name, the .gguf file's stem, or "
        "--model)",
    )
    mode: Literal["disagg", "colocated"] = option(
        "disagg", help="disagg: prefill and decode pools; colocated: the unified baseline"
    )
    prefill: int = option(1, help="prefill workers (disagg mode)")
    prefill_tp: int = option(
        1,
        help="tensor parallelism of each prefill worker: N rank processes, one worker "
        "(kvmesh serve prefill --tp N; docs/tp.md)",
    )
    decode: int = option(1, help="decode workers (colocated workers in colocated mode)")
    decode_tp: int = option(
        1,
        help="tensor parallelism of each decode worker: N rank processes, one worker "
        "(kvmesh serve decode --tp N, colocated workers too; runs without --draft and the "
        "kv-store; docs/tp.md)",
    )
    transport: TransportChoice = option("auto", help="KV data plane")
    port: int = option(8000, help="router HTTP port (0: a free one)")
    routers: int = option(
        1,
        help="router processes, all on --port (SO_REUSEPORT: the kernel spreads new "
        "connections over the live ones, so a router's death refuses nothing new; each has its "
        "own /metrics, so a scrape of the port reads one of them)",
    )
    host: str = option("127.0.0.1", help="address the router listens on (0.0.0.0: every interface)")
    local_prefill_threshold: int | None = option(
        None,
        help="prompts shorter than this are prefilled on the decode worker (default: the router's)",
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = option(
        "auto",
        help="how the router reads a chat answer's tool calls under tool_choice auto: hermes "
        '(<tool_call>{json}</tool_call>), llama3_json ({"name", "parameters"} objects) or auto '
        "(the one the model's chat template writes, else hermes)",
    )
    device: str = option("cpu", help="torch device of prefill and decode workers")
    cores: int | None = option(
        None,
        help="CPU cores the workers share (default: the cores this process may run on), shared "
        "out by --cpu-sharing (disagg) or all to the colocated workers",
    )
    decode_pacing_ms: float = option(
        0.0,
        help="disagg: decode workers start a step at most this often (their "
        "--min-step-interval-ms; 0: back to back). Near the inter-token target, it leaves "
        "decode's idle share of shared cores to prefill",
    )
    cpu_sharing: Sharing = option(
        "auto",
        help="disagg on the CPU: how prefill and decode share the cores: priority (decode "
        "first, prefill at SCHED_IDLE on every core), partition (each pool pinned to cores of "
        "its own, one prefill worker borrowing decode's while decode is idle; partition-strict: "
        "no borrowing; partition-spare: the last of several prefill workers at SCHED_IDLE on any "
        "core), equal (same priority); auto: the better of the measured ones for this machine "
        "(kvmesh up prints its choice and why; docs/load.md)",
    )
    prefill_nice: int = option(
        0,
        help="disagg: prefill workers run this much nicer (0-19, their session too) instead of "
        "at SCHED_IDLE: --cpu-sharing priority with a nice level",
    )
    kv_cache_bytes: int | None = option(
        None, help="KV pool bytes per prefill/decode worker (their default: 256 MiB)"
    )
    kv_cache_dtype: KvCacheDtype = option(
        "auto",
        help="KV cache dtype of every prefill and decode worker: auto (the model's; float16 where "
        "it is float32 and the weights are kept quantized, as llama.cpp picks), int8 (the "
        "recommended 8-bit format: a scale per 32 values of each token), fp8_e4m3 (float8 with "
        "per-(block, KV head) scales; docs/kv_cache.md), float16 or bfloat16 (half of float32's "
        "bytes beside a float32 model), float32 (whatever the weights)",
    )
    decode_kv_cache_dtype: KvCacheDtype | None = option(
        None,
        help="decode workers' KV cache dtype where it differs from --kv-cache-dtype (e.g. int8 "
        "decode pools behind model-dtype prefill: the prefill writes convert)",
    )
    log_level: LogLevelName = option("info", help="log level of every service")
    log_format: LogFormat = option("console", help="log format of every service")
    startup_timeout_s: float = option(600.0, help="seconds to wait for every service to be ready")
    max_restarts: int = option(
        5,
        help="once the mesh is up, a service that dies is restarted (after 1, 2, 4 ... 30 s); "
        "more deaths than this within 5 minutes stop the mesh (0: stop at the first death)",
    )
    stop_timeout_s: float = option(15.0, help="seconds between SIGTERM and SIGKILL on shutdown")
    draft: Literal["ngram", "early-exit", "model"] | None = option(
        None,
        help="speculative decoding: start draft workers with this method (kvmesh serve draft "
        "--method) and decode workers with --speculative; none: no drafts",
    )
    draft_workers: int = option(1, help="draft workers (with --draft)")
    num_speculative_tokens: int = option(4, help="draft tokens per proposal (with --draft)")
    draft_tree: tuple[int, ...] = option(
        (), help="draft tree branching per depth, e.g. 2,2,1 (any --draft; absent: a chain)"
    )
    draft_exit_layer: int = option(1, help="early-exit: layers of the target the draft runs")
    draft_model: str | None = option(
        None,
        help="model: the draft checkpoint directory (draft workers draft with it; prefill "
        "workers run it too, for the prompts' draft KV: --draft-kv --draft-model)",
    )
    kv_store: int = option(
        0,
        help="kv-store memory nodes to start (kvmesh serve kv-store; prefill workers read prompt "
        "prefixes from them and write computed ones to them; docs/kv_store.md)",
    )
    kv_store_capacity_gb: float = option(1.0, help="host memory of each kv-store (GiB)")
    kv_store_disk_path: str | None = option(
        None,
        help="directory for every kv-store's disk tier (their --disk-path): each store creates "
        "its own file there (a fresh name per process, unlinked at once), so one directory "
        "serves several",
    )
    kv_store_disk_capacity_gb: float | None = option(
        None, help="size of each kv-store's disk tier in GiB (--disk-capacity-gb)"
    )
    nats_insecure: bool = option(
        False,
        help="use a NATS server already at --nats-url even though it lets anyone connect without "
        "credentials (without it such a server is refused: whoever runs it reads every prompt; "
        "docs/security.md)",
    )

    def _check_tp_beside(self) -> None:
        """What tensor-parallel workers run without, refused here rather than failing each job
        (docs/tp.md): KV converted between dtypes, and kv-stores no worker would use."""
        tp = max(self.prefill_tp, self.decode_tp)
        dtype = self.decode_kv_cache_dtype
        if tp > 1 and dtype is not None and dtype != self.kv_cache_dtype:
            raise ValueError(
                f"--decode-kv-cache-dtype {dtype} beside --kv-cache-dtype {self.kv_cache_dtype} "
                "needs --prefill-tp 1 and --decode-tp 1 (tensor-parallel workers write and take "
                "KV of one dtype only): give both the same KV cache dtype"
            )
        all_tp = self.decode_tp > 1 and (self.mode == "colocated" or self.prefill_tp > 1)
        if self.kv_store and all_tp:
            raise ValueError(
                f"--kv-store {self.kv_store} would serve no worker: tensor-parallel workers run "
                "without the kv-store; drop --kv-store or run --decode-tp 1"
            )

    def __post_init__(self) -> None:
        self.check_nats_options(mesh_from_model(self.model))
        if self.served_model_name == "":
            raise ValueError("served_model_name must not be empty (leave it unset for --model)")
        if self.draft is not None:
            from kvmesh.services.draft.shape import TreeShape

            TreeShape.parse(self.num_speculative_tokens, self.draft_tree)  # ValueError: one line
            check_at_least(self, 1, "draft_workers")
            if self.draft == "model" and not self.draft_model:
                raise ValueError("--draft model needs --draft-model PATH")
        check_at_least(self, 1, "decode", "cores", "routers")
        check_at_least(self, 0, "kv_store", "max_restarts", "decode_pacing_ms")
        check_positive(
            self,
            "kv_store_capacity_gb",
            "kv_store_disk_capacity_gb",
            "startup_timeout_s",
            "stop_timeout_s",
        )
        check_at_least(self, 1, "prefill_tp", "decode_tp")
        if self.decode_tp > 1 and self.draft:
            raise ValueError(
                "--decode-tp > 1 needs no --draft (a tensor-parallel decode worker runs without "
                "speculative decoding)"
            )
        if self.prefill_tp > 1 and (self.mode != "disagg" or self.draft in ("early-exit", "model")):
            raise ValueError(
                "--prefill-tp > 1 needs --mode disagg and no prompt draft KV (--draft early-exit "
                "or model write it from one rank)"
            )
        self._check_tp_beside()
        if (self.kv_store_disk_path is None) != (self.kv_store_disk_capacity_gb is None):
            raise ValueError(
                "a kv-store disk tier needs both kv_store_disk_path and kv_store_disk_capacity_gb"
            )
        if self.kv_store_disk_path is not None and not self.kv_store:
            raise ValueError("kv_store_disk_path needs kv-stores (kv_store >= 1)")
        if self.prefill < 0 or (self.mode == "disagg" and self.prefill < 1):
            raise ValueError(f"prefill must be >= 1 in disagg mode, got {self.prefill}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.prefill_nice <= 19:
            raise ValueError(f"prefill_nice must be in [0, 19], got {self.prefill_nice}")
