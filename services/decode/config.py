"""DecodeConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.service_config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.imm import MAX_SLOTS
from kvmesh.shared.nats_options import NatsClientConfig
from kvmesh.shared.service_config import check_worker_id, option
from kvmesh.shared.subjects import mesh_from_model


@dataclass(frozen=True, slots=True)
class DecodeConfig(NatsClientConfig):
    worker_id: str | None = option(None, help="worker id (default: decode-<random>)")
    mode: Literal["disagg", "colocated"] = option(
        "disagg",
        help="disagg: prompts are prefilled remotely unless asked otherwise; "
        "colocated: every prompt is prefilled here (the baseline)",
    )
    model: str = option("kvmesh-tiny", help="model name or local HF checkpoint directory")
    dtype: str | None = option(
        None, help="model dtype (float32, bfloat16, float16); default: the checkpoint's"
    )
    device: str = option("cpu", help="torch device")
    transport: Literal["auto", "shm", "tcp", "rdma"] = option("auto", help="KV data plane backend")
    tcp_host: str = option("127.0.0.1", help="address the tcp transport listens on and advertises")
    block_size: int = option(16, help="tokens per KV block (prefill workers must match)")
    num_blocks: int | None = option(
        None, help="KV blocks in the pool (default: from kv_cache_bytes)"
    )
    kv_cache_bytes: int | None = option(None, help="KV pool size in bytes (default 256 MiB)")
    max_num_seqs: int = option(64, help="sequences decoded in one batch at most")
    max_num_batched_tokens: int = option(
        512,
        help="tokens per step: decodes first, then local prefill chunks fill the rest (a larger "
        "budget prefills faster but stalls every decoding stream for longer)",
    )
    reserve_output_tokens: int = option(
        512,
        help="admission keeps room for this many output tokens per request (at most its "
        "max_tokens), so decodes do not preempt under load; 0: admit while the prompt fits",
    )
    threads: int | None = option(
        None, help="torch CPU threads of this worker (default: torch's choice, all cores)"
    )
    min_step_interval_ms: float = option(
        0.0,
        help="start engine steps at most this often (0: back to back); set it near the "
        "inter-token latency target to leave the rest of a shared core to prefill",
    )
    max_lease_s: float = option(
        120.0, help="longest lease a reservation or renewal may ask for (longer ones are capped)"
    )
    enable_prefix_caching: bool = option(True, help="reuse KV blocks of shared prompt prefixes")
    heartbeat_s: float = option(1.0, help="seconds between heartbeats and adverts")
    lease_check_s: float = option(0.1, help="seconds between lease-expiry checks")
    quarantine_s: float = option(
        30.0,
        help="after a lease expires, seconds its blocks stay out of the pool unless the prefill "
        "confirms it stopped writing",
    )
    drain_timeout_s: float = option(10.0, help="on SIGTERM, seconds to let running requests finish")

    def __post_init__(self) -> None:
        self.check_nats_options(mesh_from_model(self.model))
        check_worker_id(self.worker_id)
        if self.quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {self.quarantine_s}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError("give num_blocks or kv_cache_bytes, not both")
        if self.num_blocks is not None and not 0 < self.num_blocks <= MAX_SLOTS:
            raise ValueError(
                f"num_blocks must be in [1, {MAX_SLOTS}] (immediates name a request by "
                f"its first block), got {self.num_blocks}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.mode == "disagg" and self.device != "cpu" and self.transport in ("shm", "tcp"):
            raise ValueError(
                f"the {self.transport} transport writes host memory, but a {self.device} decode "
                "worker keeps its KV cache on the device: use --transport rdma (or auto where a "
                "NIC exists), or --mode colocated"
            )
        if self.reserve_output_tokens < 0:
            raise ValueError(
                f"reserve_output_tokens must be >= 0, got {self.reserve_output_tokens}"
            )
        if self.min_step_interval_ms < 0:
            raise ValueError(f"min_step_interval_ms must be >= 0, got {self.min_step_interval_ms}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in ("heartbeat_s", "lease_check_s", "drain_timeout_s", "max_lease_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def role(self) -> str:
        return "colocated" if self.mode == "colocated" else "decode"
