"""RegistryConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see shared.service_config)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.service_config import DEFAULT_NATS_URL, check_worker_id, option


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    nats_url: str = option(DEFAULT_NATS_URL, help="NATS server URL")
    worker_id: str | None = option(None, help="registry id (default: kv-registry-<random>)")
    heartbeat_s: float = option(
        1.0, help="seconds between the registry's heartbeats; also the expected advert interval"
    )
    missed_heartbeats: int = option(
        3, help="a worker silent for this many heartbeat intervals is dropped"
    )
    reserve_timeout_s: float = option(
        2.0, help="seconds to wait for a decode worker's reserve reply"
    )
    max_reserve_attempts: int = option(
        2, help="decode workers tried per placement before replying overloaded"
    )
    retry_after_s: float = option(
        0.5, help="retry_after_s in overloaded replies (no decode worker has room right now)"
    )
    kv_spec: str = option(
        "", help="only place on decode workers advertising this KV layout fingerprint ('' = any)"
    )
    admin_timeout_s: float = option(2.0, help="seconds to wait for a worker's drain/resume reply")

    def __post_init__(self) -> None:
        check_worker_id(self.worker_id)
        if not self.nats_url.startswith(("nats://", "tls://")):
            raise ValueError(f"nats_url must look like nats://HOST:PORT, got {self.nats_url!r}")
        for name in ("heartbeat_s", "reserve_timeout_s", "retry_after_s", "admin_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("missed_heartbeats", "max_reserve_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def worker_timeout_s(self) -> float:
        return self.heartbeat_s * self.missed_heartbeats
