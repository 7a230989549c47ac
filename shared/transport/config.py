"""The options of every data-plane backend, built once from flags and ``KVMESH_*`` env."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


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
    shm_dir: str | None = None  # where the notification socket lives; default a fresh temp dir
    rdma_device: str | None = None  # e.g. "mlx5_0" / "rxe0"; None: first active device
    rdma_gid_index: int | None = None
    connect_timeout_s: float = 10.0
    op_timeout_s: float = 60.0  # a write/read not placed by then fails with PeerGoneError
    # Receivers: at most this many connections at once (each holds a thread), and a peer that
    # has not finished its hello within handshake_timeout_s is disconnected.
    max_connections: int = 256
    handshake_timeout_s: float = 5.0
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific knobs

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
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("connect_timeout_s", "op_timeout_s", "handshake_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
