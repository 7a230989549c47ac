"""The config fields the services share, each declared and checked once.

``ServiceConfig``: what every service that joins the mesh has (the NATS options, a worker id,
a heartbeat interval); the router builds on it. ``MetricsServiceConfig``: a service with a
metrics endpoint of its own (every one but the router, which serves them on its API port); the
kv-registry and the prefill-queue keeper build on it. ``DataPlaneConfig``: a service that moves
KV on the data plane (its backend and addresses). ``KvLayoutConfig``: one whose pool holds a
model's KV blocks (model, dtype, block size, KV cache dtype, pool blocks); the kv-store builds
on it. ``EngineWorkerConfig``: what a worker running the engine adds (device, pool bytes,
threads, CPUs, drain); prefill, decode and draft build on it. A subclass may redeclare a field to
change its default or help text (the field keeps its place); its ``__post_init__`` calls its
base's first (explicitly: zero-argument ``super()`` does not work in slotted dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.config.advertise import (
    AdvertiseHostError,
    check_advertise_host,
    resolve_transport_hosts,
)
from kvmesh.shared.config.cpu_placement import CpuPlacement, parse_cpu_list
from kvmesh.shared.config.nats_options import NatsClientConfig
from kvmesh.shared.config.service_config import (
    check_at_least,
    check_positive,
    check_worker_id,
    option,
)
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.config.subjects import DEFAULT_MESH, mesh_from_model

# --transport's choices: a backend of shared/transport (auto.BACKENDS) or auto, the best of them
TransportChoice = Literal["auto", "shm", "tcp", "rdma"]
# --kv-cache-dtype's choices: the engine's KV_CACHE_DTYPES (shared/engine/config.py)
KvCacheDtype = Literal["auto", "int8", "fp8_e4m3", "float16", "bfloat16", "float32"]


@dataclass(frozen=True, slots=True)
class ServiceConfig(NatsClientConfig):
    """NATS options, worker id and heartbeat interval: every service has them."""

    worker_id: str | None = option(None, help="worker id (default: <role>-<random>)")
    heartbeat_s: float = option(1.0, help="seconds between heartbeats")
    loop_stall_limit_s: float | None = option(
        None,
        help="seconds the event loop may go without a tick (a long step) while the heartbeats, "
        "sent from a thread of their own, go on; past it they stop and the mesh drops the worker "
        "(default: 30, or ten heartbeats if longer)",
    )

    def __post_init__(self) -> None:
        self.check_nats_options(self.default_mesh())
        check_worker_id(self.worker_id)
        check_positive(self, "heartbeat_s")
        if self.loop_stall_limit_s is not None and self.loop_stall_limit_s <= self.heartbeat_s:
            raise ValueError(
                f"loop_stall_limit_s ({self.loop_stall_limit_s:g}) must be longer than "
                f"heartbeat_s ({self.heartbeat_s:g})"
            )

    @property
    def stall_limit_s(self) -> float:
        """``loop_stall_limit_s``, or its default: 30 s, or ten heartbeats if longer."""
        if self.loop_stall_limit_s is not None:
            return self.loop_stall_limit_s
        return max(30.0, 10 * self.heartbeat_s)

    def default_mesh(self) -> str:
        """The mesh when ``--mesh`` is not given (services with a model derive it from that)."""
        return DEFAULT_MESH


@dataclass(frozen=True, slots=True)
class MetricsServiceConfig(ServiceConfig):
    """A service that serves its Prometheus metrics on a port of its own (``--metrics-port``)."""

    metrics_host: str = option(
        "127.0.0.1", help="address the metrics endpoint listens on (0.0.0.0: every interface)"
    )
    metrics_port: int | None = option(
        None,
        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: a free port; none: off)",
    )

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(
                f"metrics_port must be in [0, 65535] (or none: off), got {self.metrics_port}"
            )


@dataclass(frozen=True, slots=True)
class DataPlaneConfig(MetricsServiceConfig):
    """A service that moves KV on the data plane (engine workers, kv-stores): its backend and
    the addresses it listens on and is reached at."""

    transport: TransportChoice = option("auto", help="KV data plane backend")
    tcp_host: str | None = option(
        None,
        help="address the data plane listens on (tcp lanes, the rdma side channel); 0.0.0.0 "
        "for every interface (default: --advertise-host)",
    )
    advertise_host: str | None = option(
        None,
        help="address peers on other hosts dial to reach this service's data plane (default: "
        "the address of the interface that routes to the NATS server; 127.0.0.1 on one host)",
    )

    def __post_init__(self) -> None:
        MetricsServiceConfig.__post_init__(self)
        if self.advertise_host is not None:
            check_advertise_host(self.advertise_host)

    def transport_hosts(self) -> tuple[str, str]:
        """``(bind, advertise)`` of the data plane (shared/config/advertise.py): the advertise host
        defaults to the interface routing to NATS, the bind address to the advertise host.
        Raises ServiceStartError (printed as one line) when peers could not dial the result."""
        try:
            return resolve_transport_hosts(self.tcp_host, self.advertise_host, self.nats_url)
        except AdvertiseHostError as exc:
            raise ServiceStartError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class KvLayoutConfig(DataPlaneConfig):
    """A data-plane service whose pool holds one model's KV blocks (engine workers, kv-stores):
    the model, dtype, block size and KV cache dtype that make the blocks' layout (peers
    exchanging blocks must agree on it) and the pool's size in blocks. The mesh defaults to the
    model's."""

    model: str = option("kvmesh-tiny", help="model name or local HF checkpoint directory")
    dtype: str | None = option(
        None, help="model dtype (float32, bfloat16, float16); default: the checkpoint's"
    )
    block_size: int = option(16, help="tokens per KV block (prefill and decode workers must match)")
    kv_cache_dtype: KvCacheDtype = option(
        "auto",
        help="KV cache dtype: auto (the model's; float16 where it is float32 and the weights are "
        "kept quantized, as llama.cpp picks), int8 (the recommended 8-bit format: a scale per "
        "32 values of each token, 9/32 of float32's bytes), fp8_e4m3 (float8 with per-(block, "
        "KV head) scales, a quarter; changes a trained model's answers), float16 or bfloat16 "
        "(half of float32's bytes beside a float32 model), float32 (whatever the weights); "
        "prefill and decode workers may differ in it: the prefill's writes convert "
        "(docs/kv_cache.md)",
    )
    num_blocks: int | None = option(
        None, help="KV blocks in this worker's pool (default: from kv_cache_bytes)"
    )

    def __post_init__(self) -> None:
        DataPlaneConfig.__post_init__(self)
        if not self.model:
            raise ValueError("model must name a model or a checkpoint directory")
        check_positive(self, "block_size", "num_blocks")

    def default_mesh(self) -> str:
        return mesh_from_model(self.model)


@dataclass(frozen=True, slots=True)
class EngineWorkerConfig(KvLayoutConfig):
    """A worker that runs the engine over a KV pool and moves KV on the data plane."""

    device: str = option("cpu", help="torch device")
    kv_cache_bytes: int | None = option(None, help="KV pool size in bytes (default 256 MiB)")
    threads: int | None = option(
        None, help="torch CPU threads of this worker (default: torch's choice, all cores)"
    )
    cpus: str | None = option(
        None,
        help="run only on these CPUs, e.g. 0-3,8 (hard partitioning of shared cores; default: "
        "wherever it was started)",
    )
    nice: int = option(
        0,
        help="raise this worker's niceness by N (0-19) at start, its session's (autogroup's) "
        "too: on cores it shares with latency-critical workers, they run first",
    )
    sched_idle: bool = option(
        False,
        help="run every thread at SCHED_IDLE (its autogroup at nice 19): on shared cores it "
        "takes only the cycles no other worker wants (docs/load.md, Cores)",
    )
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prompt prefixes")
    drain_timeout_s: float = option(
        10.0, help="on SIGTERM, seconds to let the work in hand finish before it is aborted"
    )

    def __post_init__(self) -> None:
        KvLayoutConfig.__post_init__(self)
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        check_positive(self, "kv_cache_bytes", "drain_timeout_s")
        check_at_least(self, 1, "threads")
        self.cpu_placement()  # ValueError: a bad --cpus or --nice, in one line
        if self.uses_data_plane and self.device != "cpu" and self.transport in ("shm", "tcp"):
            raise ValueError(
                f"the {self.transport} transport moves host memory, but a {self.device} worker "
                "keeps its KV cache on the device: use --transport rdma (or auto where a NIC "
                "exists)"
            )

    def cpu_placement(self) -> CpuPlacement:
        cpus = parse_cpu_list(self.cpus) if self.cpus is not None else frozenset()
        return CpuPlacement(cpus, self.nice, self.sched_idle)

    @property
    def uses_data_plane(self) -> bool:
        """Whether this worker moves KV over ``transport`` (a colocated decode worker does not)."""
        return True
