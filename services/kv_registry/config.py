"""RegistryConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.config.service_config import check_at_least, check_positive, option
from kvmesh.shared.config.worker_config import MetricsServiceConfig


@dataclass(frozen=True, slots=True)
class RegistryConfig(MetricsServiceConfig):
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
    prefix_weight: float = option(
        1.0,
        help="placement score per prompt block cached on a worker "
        "(score = prefix_weight * (cached_blocks + store_block_weight * read_blocks) - "
        "load_weight * load; 0: prefix-aware placement off, stores included)",
    )
    store_block_weight: float = option(
        0.5,
        help="a prompt block a decode worker would read from the kv-store it reads, past the "
        "ones it caches, scores this fraction of a cached block (0..1; 0: stores are not counted "
        "and never make a local prefill)",
    )
    load_weight: float = option(
        4.0, help="placement score taken per request running, waiting or being placed on a worker"
    )
    local_max_suffix_tokens: int = option(
        512,
        help="a remote-prefill request placed where its prefix is cached is prefilled by that "
        "decode worker when at most this many prompt tokens are left uncached (0: never)",
    )
    max_cached_blocks_per_worker: int = option(
        65_536, help="prefix index entries kept per decode worker (least recently used dropped)"
    )

    def __post_init__(self) -> None:
        MetricsServiceConfig.__post_init__(self)
        check_positive(self, "reserve_timeout_s", "retry_after_s", "admin_timeout_s")
        check_at_least(self, 0, "prefix_weight", "load_weight", "local_max_suffix_tokens")
        if not 0 <= self.store_block_weight <= 1:
            raise ValueError(f"store_block_weight must be in [0, 1], got {self.store_block_weight}")
        check_at_least(
            self, 1, "missed_heartbeats", "max_reserve_attempts", "max_cached_blocks_per_worker"
        )

    @property
    def worker_timeout_s(self) -> float:
        return self.heartbeat_s * self.missed_heartbeats
