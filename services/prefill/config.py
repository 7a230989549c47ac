"""PrefillConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.service_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.nats_options import NatsClientConfig
from kvmesh.shared.service_config import check_worker_id, option
from kvmesh.shared.subjects import mesh_from_model


@dataclass(frozen=True, slots=True)
class PrefillConfig(NatsClientConfig):
    worker_id: str | None = option(None, help="worker id (default: prefill-<random>)")
    model: str = option("kvmesh-tiny", help="model name or local HF checkpoint directory")
    dtype: str | None = option(
        None, help="model dtype (float32, bfloat16, float16); default: the checkpoint's"
    )
    device: str = option("cpu", help="torch device")
    transport: Literal["auto", "shm", "tcp", "rdma"] = option("auto", help="KV data plane backend")
    tcp_host: str = option("127.0.0.1", help="address the tcp transport listens on")
    block_size: int = option(16, help="tokens per KV block (must match the decode workers)")
    num_blocks: int | None = option(
        None, help="KV blocks in the local pool (default: from kv_cache_bytes)"
    )
    kv_cache_bytes: int | None = option(None, help="local KV pool size in bytes (default 256 MiB)")
    chunk_tokens: int = option(
        512,
        help="prefill tokens per forward pass (shared by the jobs in flight); each chunk's "
        "blocks are written to the decode worker while the next chunk computes",
    )
    max_concurrent_jobs: int = option(
        1,
        help="prefill jobs this worker holds at once (pulled from the queue only when a slot is "
        "free; few slots keep jobs first-come-first-served and leave the rest to idle peers)",
    )
    threads: int | None = option(
        None, help="torch CPU threads of this worker (default: torch's choice, all cores)"
    )
    nice: int = option(
        0,
        help="raise this worker's niceness by N (0-19) at start: on cores it shares with decode "
        "workers, decode steps (latency) then run first and prefill (throughput) takes the rest",
    )
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prompt prefixes")
    heartbeat_s: float = option(1.0, help="seconds between heartbeats")
    abort_memory_s: float = option(
        660.0,
        help="how long an Abort is remembered for jobs not yet taken (longer than a job may wait "
        "in the queue, 600 s, so an aborted job is never computed)",
    )

    def __post_init__(self) -> None:
        self.check_nats_options(mesh_from_model(self.model))
        check_worker_id(self.worker_id)
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.chunk_tokens < self.block_size:
            raise ValueError(
                f"chunk_tokens ({self.chunk_tokens}) must hold at least one block ({self.block_size} tokens)"
            )
        if self.max_concurrent_jobs <= 0:
            raise ValueError(
                f"max_concurrent_jobs must be positive, got {self.max_concurrent_jobs}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in [0, 19] (a lower priority only), got {self.nice}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        for name in ("num_blocks", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.device != "cpu" and self.transport in ("shm", "tcp"):
            raise ValueError(
                f"the {self.transport} transport reads host memory, but a {self.device} prefill "
                "worker keeps its KV cache on the device: use --transport rdma (or auto where a "
                "NIC exists)"
            )
        for name in ("heartbeat_s", "abort_memory_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
