"""Whether a NATS server can be trusted with a mesh, asked before anything is sent to it.

A server anybody can connect to is anybody's: an unprivileged local user who starts an open
``nats-server -js`` on the port first gets every prompt, every window key and admin control of a
mesh that joins it (issue 27). Two checks use the server's first line, its ``INFO`` (sent in the
clear before any TLS or login): ``kvmesh up`` joins a server it did not start only when that
server demands credentials (``vet_foreign_server``; ``--nats-insecure`` overrides), and a
service given credentials refuses a server that asks for none (``shared/bus/nats_service.py``):
such a server is not the one the credentials were made for. When the port is on this machine,
the refusal says whose process holds it (``port_holder``: /proc/net/tcp and the holder's fds).
"""

from __future__ import annotations

import json
import os
import pwd
import socket
from dataclasses import dataclass
from pathlib import Path

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")


class NatsVettingError(RuntimeError):
    """The server at the URL must not be trusted with this mesh; the message says why and what
    to do."""


def parse_info(line: bytes) -> dict:
    """The JSON of a NATS ``INFO {...}`` line. ValueError when it is not one."""
    if not line.startswith(b"INFO "):
        raise ValueError(f"not a NATS INFO line: {line[:40]!r}")
    info = json.loads(line[5:].strip())
    if not isinstance(info, dict):
        raise ValueError("the INFO line holds no JSON object")
    return info


def server_info(host: str, port: int, timeout_s: float = 2.0) -> dict:
    """The server's INFO, read from a fresh connection (nothing is sent). OSError or
    ValueError when nothing at ``host:port`` speaks NATS."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.settimeout(timeout_s)
        data = b""
        while b"\r\n" not in data and len(data) < 65536:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return parse_info(data.split(b"\r\n", 1)[0])


@dataclass(frozen=True, slots=True)
class PortHolder:
    uid: int
    pid: int | None  # None: the socket is not among the fds this process may read
    command: str

    def describe(self) -> str:
        try:
            user = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            user = f"uid {self.uid}"
        mine = " (you)" if self.uid == os.getuid() else ""
        if self.pid is None:
            return f"a process of user {user}{mine}"
        return f"pid {self.pid} ({self.command or '?'}) of user {user}{mine}"


def _listening_inodes(port: int, proc: Path) -> list[tuple[int, int]]:
    """``(inode, uid)`` of every TCP socket listening on ``port`` (IPv4 and IPv6)."""
    found = []
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.append((int(fields[9]), int(fields[7])))
    return found


def port_holder(port: int, proc: Path = Path("/proc")) -> PortHolder | None:
    """Who listens on TCP ``port`` on this machine: the socket's owner from /proc/net/tcp, and
    the process whose fd is that socket when this process may look (its own user's, or root).
    None when nothing listens there (or /proc says nothing)."""
    sockets = _listening_inodes(port, proc)
    if not sockets:
        return None
    inode, uid = sockets[0]
    target = f"socket:[{inode}]"
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    raw = (pid_dir / "cmdline").read_bytes()
                    command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
                    return PortHolder(uid, int(pid_dir.name), command[:120])
            except OSError:
                continue
    return PortHolder(uid, None, "")


def holder_note(host: str, port: int) -> str:
    """ ", held by ..." for a port on this machine whose holder /proc names; "" otherwise."""
    if host not in LOCAL_HOSTS:
        return ""
    holder = port_holder(port)
    return f", held by {holder.describe()}" if holder is not None else ""


def vet_foreign_server(host: str, port: int, *, insecure: bool) -> dict:
    """``kvmesh up``'s check of a server already listening where it was told to run the mesh:
    its INFO when it demands credentials (or ``insecure``); NatsVettingError when it does not.
    An empty dict when nothing speaks NATS there any more (connecting says so next)."""
    try:
        info = server_info(host, port)
    except (OSError, ValueError):
        return {}
    if info.get("auth_required") or insecure:
        return info
    raise NatsVettingError(
        f"the NATS server at {host}:{port}{holder_note(host, port)} was not started by this "
        "kvmesh up and lets anyone connect without credentials: whoever runs it would read "
        "every prompt, every lease's window key and admin control; stop it and let kvmesh up "
        "start its own (or give --nats-url a free port), give that server users (kvmesh "
        "nats-config), or pass --nats-insecure to use it anyway"
    )


def vet_nats_url(url: str, *, insecure: bool) -> None:
    """``vet_foreign_server`` for the first server of ``url`` (a cluster's members share their
    configuration)."""
    from kvmesh.shared.bus.nats_options import split_nats_urls
    from kvmesh.shared.bus.nats_server import parse_nats_url

    host, port = parse_nats_url(split_nats_urls(url)[0])
    vet_foreign_server(host, port, insecure=insecure)
