"""Local ports for services that bind them later, picked below the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_FREE_PORT = 10_000  # free_port's picks start here (below: well-known services)


def ephemeral_port_range(path: Path = EPHEMERAL_PORTS) -> tuple[int, int]:
    """The kernel's range for outgoing connections' and port-0 binds' local ports (Linux's
    default where it cannot be read)."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(rng: random.Random | None = None, path: Path = EPHEMERAL_PORTS) -> int:
    """A local port free now, for a child that binds it later (a worker's metrics, the
    router, NATS). Picked below the kernel's ephemeral range where there is room: a port-0 bind
    would hand out an ephemeral port, which any outgoing connection (the workers' NATS
    clients start meanwhile) may take before the child binds it (a child of `kvmesh up` once
    exited on "address already in use" for its metrics port). Outside that range only another
    explicit bind can take it. Falls back to a port-0 bind."""
    low, _ = ephemeral_port_range(path)
    rng = rng or random.SystemRandom()
    if low - LOWEST_FREE_PORT >= 1000:
        for _ in range(64):
            port = rng.randrange(LOWEST_FREE_PORT, low)
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
