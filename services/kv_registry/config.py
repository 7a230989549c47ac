"""RegistryConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.service_config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.metrics_exporter import (
    check_metrics_port,
    metrics_host_option,
    metrics_port_option,
)
from kvmesh.shared.service_config import option
from kvmesh.shared.worker_config import ServiceConfig


@dataclass(frozen=True, slots=True)
class RegistryConfig(ServiceConfig):
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
    metrics_host: str = metrics_host_option()
    metrics_port: int | None = metrics_port_option()

    def __post_init__(self) -> None:
        ServiceConfig.__post_init__(self)
        check_metrics_port(self.metrics_port)
        for name in ("reserve_timeout_s", "retry_after_s", "admin_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("missed_heartbeats", "max_reserve_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def worker_timeout_s(self) -> float:
        return self.heartbeat_s * self.missed_heartbeats
