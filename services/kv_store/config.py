"""StoreConfig: flags ``--x-y`` / env ``KVMESH_X_Y`` for every field (see kvmesh.shared.config.service_config)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.config.service_config import check_positive, option
from kvmesh.shared.config.worker_config import KvCacheDtype, KvLayoutConfig

DEFAULT_CAPACITY_GB = 1.0


@dataclass(frozen=True, slots=True)
class StoreConfig(KvLayoutConfig):
    """The KV layout's fields (kvmesh.shared.config.worker_config; their help says what they mean to
    a store, which runs no model) and the store's own."""

    worker_id: str | None = option(None, help="store id (default: kv-store-<random>)")
    heartbeat_s: float = option(1.0, help="seconds between heartbeats and store adverts")
    model: str = option(
        "kvmesh-tiny",
        help="model whose KV blocks it stores (config.json and the safetensors headers; no weights)",
    )
    dtype: str | None = option(
        None, help="the decode workers' --dtype (float32, bfloat16, float16); default: the model's"
    )
    block_size: int = option(16, help="tokens per KV block (as the decode workers')")
    kv_cache_dtype: KvCacheDtype = option(
        "auto",
        help="the workers' --kv-cache-dtype: auto (the model's dtype; float16 for float32 over "
        "weights kept quantized), int8, fp8_e4m3, float16, bfloat16 or float32",
    )
    num_blocks: int | None = option(
        None, help="blocks in the store's pool (default: --capacity-gb)"
    )
    capacity_gb: float | None = option(
        None, help=f"pool size in GiB of host memory (default {DEFAULT_CAPACITY_GB:g})"
    )
    disk_path: str | None = option(
        None,
        help="directory for a disk tier: blocks the host pool evicts are spilled to a file "
        "created there (O_EXCL, mode 0600, unlinked at once; never reused by a restart)",
    )
    disk_capacity_gb: float | None = option(
        None, help="size in GiB of the disk tier's file (needs --disk-path)"
    )
    max_lease_s: float = option(
        120.0, help="longest a put or get may hold its slots (longer leases are capped)"
    )
    lease_check_s: float = option(0.1, help="seconds between lease-expiry checks")
    commit_wait_s: float = option(
        1.0,
        help="at a commit, how long to wait for the put's write to complete here (its immediate) "
        "before its window closes",
    )
    retry_after_s: float = option(
        0.5, help="retry_after_s of a put refused because every slot is pinned"
    )
    put_roles: str = option(
        "decode,colocated,prefill",
        help="comma list of the NATS roles whose workers may put blocks (a put's reply inbox "
        "names its role; docs/security.md)",
    )
    writer_share: float = option(
        0.5,
        help="the share of the store's blocks (host and disk) one writer may hold; past it, its "
        "puts recycle its own least recently used blocks (1: no limit)",
    )
    cache_events_interval_s: float = option(
        0.25,
        help="seconds between reports of the changes to the block hashes held to the "
        "kv-registry's prefix index (KvCacheEvents; none while nothing changes)",
    )
    cache_digest_interval_s: float = option(
        5.0,
        help="seconds between full reports of the block hashes held (KvCacheDigest): a registry "
        "that restarted or missed a report is in sync again after at most this long",
    )

    def __post_init__(self) -> None:
        KvLayoutConfig.__post_init__(self)
        if self.num_blocks is not None and self.capacity_gb is not None:
            raise ValueError("give num_blocks or capacity_gb, not both")
        if (self.disk_path is None) != (self.disk_capacity_gb is None):
            raise ValueError("a disk tier needs both disk_path and disk_capacity_gb")
        if self.disk_path is not None and not self.disk_path:
            raise ValueError("disk_path must name a directory")
        check_positive(
            self,
            "capacity_gb",
            "disk_capacity_gb",
            "max_lease_s",
            "lease_check_s",
            "retry_after_s",
            "commit_wait_s",
            "cache_events_interval_s",
            "cache_digest_interval_s",
        )
        if not 0 < self.writer_share <= 1:
            raise ValueError(f"writer_share must be in (0, 1], got {self.writer_share}")
        if not self.allowed_put_roles:
            raise ValueError("put_roles must name at least one role (e.g. decode,prefill)")

    @property
    def allowed_put_roles(self) -> frozenset[str]:
        return frozenset(r.strip() for r in self.put_roles.split(",") if r.strip())

    def resolve_num_blocks(self, block_bytes: int) -> int:
        """Blocks the pool holds: --num-blocks, else --capacity-gb of block_bytes each."""
        if self.num_blocks is not None:
            return self.num_blocks
        capacity = int((self.capacity_gb or DEFAULT_CAPACITY_GB) * (1 << 30))
        num = capacity // block_bytes
        if num < 1:
            raise ValueError(
                f"capacity_gb {self.capacity_gb} holds no block of {block_bytes} bytes"
            )
        return num

    def resolve_disk_slots(self, slot_bytes: int) -> int:
        """Slots of ``slot_bytes`` (a block and its header) in --disk-capacity-gb; 0: no tier."""
        if self.disk_capacity_gb is None:
            return 0
        num = int(self.disk_capacity_gb * (1 << 30)) // slot_bytes
        if num < 1:
            raise ValueError(
                f"disk_capacity_gb {self.disk_capacity_gb} holds no block of {slot_bytes} bytes"
            )
        return num
