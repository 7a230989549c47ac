"""The options of every data-plane backend, built once from flags and ``KVMESH_*`` env."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.config.service_config import check_at_least, check_positive
from kvmesh.shared.transport.server import ServerLimits
from kvmesh.shared.transport.source_budget import SourceLimits


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Options for every backend; build once from flags / ``KVMESH_*`` env and pass down."""

    peer_id: str | None = None  # default: "<hostname>-<pid>-<random>"
    tcp_host: str = "127.0.0.1"  # address to listen on
    tcp_advertise_host: str | None = None  # address peers dial; default tcp_host
    tcp_port: int = 0  # 0: any free port
    tcp_lanes: int = 2  # sockets per endpoint (more help on many-core hosts)
    tcp_window: int = 8  # in-flight bytes per lane = tcp_window * tcp_slice_bytes (backpressure)
    tcp_slice_bytes: int = 4 << 20  # large writes are cut into slices of at most this many bytes
    # where the same-host unix sockets live (shm's notifications, tcp's lanes): a fresh private
    # folder is made there; default the temp folder
    shm_dir: str | None = None
    # tcp receivers also listen on a unix socket, and writers on the same host dial it
    # (unix_lanes.py: the peer's uid is checked); TCP stays the cross-host path and the fallback
    tcp_unix_lanes: bool = True
    rdma_device: str | None = None  # e.g. "mlx5_0" / "rxe0"; None: first active device
    rdma_gid_index: int | None = None
    connect_timeout_s: float = 10.0
    # a lane whose connect or handshake is reset or refused is retried (jittered exponential
    # backoff) until this long has passed since the endpoint's first try (one deadline for all
    # its lanes), then the peer is reported unreachable
    connect_retry_s: float = 3.0
    op_timeout_s: float = 60.0  # a write/read not placed by then fails with PeerGoneError
    # Receivers (server.py): a connection holds no thread until its hello is proven; at most
    # max_pending_handshakes of those at once (max_pending_per_source from one address; a new
    # one pushes out the oldest), each dropped after handshake_timeout_s. Admitted: at most
    # max_connections (each holds a thread), max_connections_per_peer per declared peer id.
    max_connections: int = 256
    max_connections_per_peer: int = 32
    max_pending_handshakes: int = 1024
    max_pending_per_source: int = 256
    handshake_timeout_s: float = 5.0
    # Per source address (source_budget.py): accepts_per_source_s new connections a second
    # (accept_burst_per_source at once); max_refusals_per_source refused accesses per
    # source_block_s, past which the source is blocked for source_block_s.
    accepts_per_source_s: float = 64.0
    accept_burst_per_source: int = 256
    max_refusals_per_source: int = 64
    source_block_s: float = 30.0
    # tcp lanes: a lane silent for idle_timeout_s is closed (writers send a keepalive every
    # keepalive_s, so theirs never are); a frame whose bytes stop for stall_timeout_s (or come
    # slower than 16 MiB/s after that grace) is dropped with its endpoint; an endpoint that has
    # max_refusals accesses refused is disconnected (every refusal is counted and logged).
    idle_timeout_s: float = 60.0
    keepalive_s: float = 15.0
    stall_timeout_s: float = 10.0
    max_refusals: int = 16
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific knobs

    def server_limits(self) -> ServerLimits:
        return ServerLimits(
            max_connections=self.max_connections,
            max_per_peer=self.max_connections_per_peer,
            max_pending=self.max_pending_handshakes,
            max_pending_per_source=self.max_pending_per_source,
            handshake_timeout_s=self.handshake_timeout_s,
        )

    def source_limits(self) -> SourceLimits:
        return SourceLimits(
            accepts_per_s=self.accepts_per_source_s,
            accept_burst=self.accept_burst_per_source,
            max_refusals=self.max_refusals_per_source,
            block_s=self.source_block_s,
        )

    def __post_init__(self) -> None:
        if not 0 <= self.tcp_port < 65536:
            raise ValueError(f"tcp_port must be in [0, 65536), got {self.tcp_port}")
        for name in ("tcp_lanes", "tcp_window"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be in [1, 64], got {getattr(self, name)}")
        if not 4096 <= self.tcp_slice_bytes <= 1 << 30:
            raise ValueError(
                f"tcp_slice_bytes must be in [4 KiB, 1 GiB], got {self.tcp_slice_bytes}"
            )
        check_at_least(
            self,
            1,
            "max_connections",
            "max_connections_per_peer",
            "max_pending_handshakes",
            "max_pending_per_source",
            "max_refusals",
            "accept_burst_per_source",
            "max_refusals_per_source",
        )
        if self.keepalive_s >= self.idle_timeout_s:
            raise ValueError(
                f"keepalive_s ({self.keepalive_s}) must be below idle_timeout_s "
                f"({self.idle_timeout_s}), or the receiver closes idle writers' lanes"
            )
        check_positive(
            self,
            "connect_timeout_s",
            "connect_retry_s",
            "op_timeout_s",
            "handshake_timeout_s",
            "idle_timeout_s",
            "keepalive_s",
            "stall_timeout_s",
            "accepts_per_source_s",
            "source_block_s",
        )
