"""Local ports for services that bind them later, picked below the kernel's ephemeral range and,
for `kvmesh up`'s children, held until they bind them."""

from __future__ import annotations

import errno
import random
import socket
from collections import deque
from pathlib import Path

EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_FREE_PORT = 10_000  # free_port's picks start here (below: well-known services)
# This process's last picks, not handed out again: two picks before either is bound (a mesh's
# router and its NATS) must differ, and each free_port call releases its check.
_handed: deque[int] = deque(maxlen=256)


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
    explicit bind can take it; and this process does not hand out one of its last 256 picks
    again. Falls back to a port-0 bind."""
    low, _ = ephemeral_port_range(path)
    rng = rng or random.SystemRandom()
    if low - LOWEST_FREE_PORT >= 1000:
        for _ in range(64):
            port = rng.randrange(LOWEST_FREE_PORT, low)
            if port in _handed:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed.append(port)
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    _handed.append(port)
    return port


def held_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> socket.socket:
    """A port free now and kept for a child until the returned socket is closed: bound, not
    listening, with SO_REUSEADDR. A child's server binds and listens on it all the same
    (asyncio's and aiohttp's servers set SO_REUSEADDR on Unix, and Linux lets such a socket
    share a port with others that set it and do not listen), while a bind without that option
    fails on it: free_port's check, so no other pick takes it (a draft worker once found its
    metrics port taken between the launcher's pick and its bind). Connections to it are refused
    until the child listens and after it exits."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(64):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, free_port(rng)))
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:  # not a race: an address this machine lacks
                raise
            continue  # taken since the pick
        return sock
    raise OSError(errno.EADDRINUSE, f"no free port to hold on {host} after 64 picks")
