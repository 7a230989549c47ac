"""Whether a NATS server can be trusted with a mesh, asked before anything is sent to it.

A server anybody can connect to is anybody's: an unprivileged local user who starts an open
``nats-server -js`` on the port first gets every prompt, every window key and admin control of a
mesh that joins it (issue 27). Two checks use the server's first line, its ``INFO`` (sent in the
clear before any TLS or login): ``kvmesh up`` joins a server it did not start only when that
server demands credentials (``vet_foreign_server``; ``--nats-insecure`` overrides), and a
service given credentials refuses a server that asks for none (``shared/bus/nats_connect.py``):
such a server is not the one the credentials were made for. When the port is on this machine,
the refusal says whose process holds it (``port_holder``: /proc/net/tcp and the holder's fds).

INFO is the server's word about itself, and a 40-line proxy can add ``"auth_required":true`` to
an open server's (issue 40). What decides is who holds the socket: credentials go only to a
server whose end of this very connection belongs to this user or root on this machine
(``connection_owner``, read from /proc/net/tcp after the TCP handshake and before CONNECT, so a
listener swapped in between changes nothing), or one that proved itself by TLS, or, on a private
network the operator vouches for, any (``--nats-trust-network``). ``vet_connection`` says which;
``shared/bus/nats_connect.py`` asks it before every CONNECT, reconnects included.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pwd
import socket
from collections.abc import Iterator
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


def _endpoint(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp{,6} (``0100007F:1F90``: the host's byte order per 32-bit
    word, then the port) as an address and a port; IPv4-mapped IPv6 as IPv4."""
    raw, port = field.rsplit(":", 1)
    packed = b"".join(bytes.fromhex(raw[i : i + 8])[::-1] for i in range(0, len(raw), 8))
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)


def _normal(host: str, port: int) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, port


def connection_owner(
    ours: tuple[str, int], theirs: tuple[str, int], proc: Path = Path("/proc")
) -> int | None:
    """The uid that owns the far end of this process's TCP connection from ``ours`` (its
    sockname) to ``theirs`` (its peername) when that end is a socket on this machine (in this
    network namespace): the server's accepted socket, whose owner is its listener's. None when
    no socket here is that end (the server is on another host or in another namespace)."""
    want_local, want_remote = _normal(*theirs), _normal(*ours)
    for fields in _tcp_rows(proc):
        if len(fields) < 8:
            continue
        try:
            local, remote = _endpoint(fields[1]), _endpoint(fields[2])
        except ValueError:
            continue
        if local == want_local and remote == want_remote:
            return int(fields[7])
    return None


def vet_connection(
    ours: tuple[str, int] | None,
    theirs: tuple[str, int] | None,
    *,
    tls_verified: bool,
    trust_network: bool,
    proc: Path = Path("/proc"),
) -> str | None:
    """Why credentials must not be sent over this connection, or None when they may: the server
    is this user's or root's on this machine, proved itself by TLS, or the operator trusts the
    network. ``ours``/``theirs``: the socket's own and peer addresses (None: not a TCP socket)."""
    if tls_verified or trust_network:
        return None
    owner = connection_owner(ours, theirs, proc) if ours and theirs else None
    if owner is not None and owner in (os.geteuid(), 0):
        return None
    where = f"{theirs[0]}:{theirs[1]}" if theirs else "the server"
    if owner is not None:
        holder = port_holder(theirs[1], proc) if theirs else None
        who = holder.describe() if holder is not None and holder.uid == owner else ""
        who = who or PortHolder(owner, None, "").describe()
        return (
            f"the NATS server at {where} is held by {who}, not by this user or root: whatever "
            "its INFO says, it is not this mesh's server, and no credentials are sent to it; "
            "stop it, or run the mesh's server on another port"
        )
    return (
        f"the NATS server at {where} is not on this machine and did not prove itself by TLS: "
        "credentials go only to a server this user (or root) runs here, or one with a "
        "certificate (tls:// URL, --nats-tls-ca); on a private network you control, "
        "--nats-trust-network (KVMESH_NATS_TRUST_NETWORK=1) sends them anyway"
    )


def _listening_inodes(port: int, proc: Path) -> list[tuple[int, int]]:
    """``(inode, uid)`` of every TCP socket listening on ``port`` (IPv4 and IPv6)."""
    found = []
    for fields in _tcp_rows(proc):
        if len(fields) < 10 or fields[3] != "0A":  # 0A: LISTEN
            continue
        if int(fields[1].rsplit(":", 1)[1], 16) == port:
            found.append((int(fields[9]), int(fields[7])))
    return found


def _tcp_rows(proc: Path) -> Iterator[list[str]]:
    """The fields of every socket row of /proc/net/tcp and /proc/net/tcp6 (a table that cannot
    be read is skipped)."""
    for table in ("net/tcp", "net/tcp6"):
        try:
            lines = (proc / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            yield line.split()


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


def is_local_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (or every address: ``0.0.0.0``)."""
    if host in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def holder_note(host: str, port: int) -> str:
    """ ", held by ..." for a port on this machine whose holder /proc names; "" otherwise."""
    if not is_local_host(host):
        return ""
    holder = port_holder(port)
    return f", held by {holder.describe()}" if holder is not None else ""


def vet_foreign_server(
    host: str,
    port: int,
    *,
    insecure: bool,
    has_credentials: bool = False,
    tls: bool = False,
    trust_network: bool = False,
) -> dict:
    """``kvmesh up``'s check of a server already listening where it was told to run the mesh,
    before anything is sent to it: its INFO when kvmesh up may join it, NatsVettingError (the
    message says why and what to do) when not. It joins a server it did not start only with
    credentials for it, and on this machine only one this user or root runs (unless TLS, or
    ``trust_network``); ``insecure`` (``--nats-insecure``) joins any. The connection's own
    check (``vet_connection``) runs again before CONNECT. An empty dict when nothing speaks
    NATS there any more (connecting says so next)."""
    try:
        info = server_info(host, port)
    except (OSError, ValueError):
        return {}
    if insecure:
        return info
    where = f"{host}:{port}{holder_note(host, port)}"
    if not info.get("auth_required"):
        raise NatsVettingError(
            f"the NATS server at {where} was not started by this kvmesh up and lets anyone "
            "connect without credentials: whoever runs it would read every prompt, every "
            "lease's window key and admin control; stop it and let kvmesh up start its own (or "
            "give --nats-url a free port), give that server users (kvmesh nats-config), or pass "
            "--nats-insecure to use it anyway"
        )
    if not has_credentials:
        raise NatsVettingError(
            f"the NATS server at {where} was not started by this kvmesh up, and kvmesh up has "
            "no credentials for it: a server's word that it demands them proves nothing, so "
            "kvmesh up joins another's server only with its credentials (KVMESH_NATS_USER and "
            "KVMESH_NATS_PASSWORD, a URL with them, or --nats-creds) and only when it can tell "
            "who runs it; or give --nats-url a free port and kvmesh up starts its own"
        )
    if not (tls or trust_network) and is_local_host(host):
        holder = port_holder(port)
        if holder is not None and holder.uid not in (os.geteuid(), 0):
            raise NatsVettingError(
                f"the NATS server at {host}:{port} is held by {holder.describe()}, not by this "
                "user or root: no credentials are sent to it; stop it, or give --nats-url a "
                "free port and kvmesh up starts its own"
            )
    return info


def vet_nats_url(
    url: str,
    *,
    insecure: bool,
    has_credentials: bool = False,
    tls: bool = False,
    trust_network: bool = False,
) -> None:
    """``vet_foreign_server`` for the first server of ``url`` (a cluster's members share their
    configuration)."""
    from kvmesh.shared.bus.nats_server import parse_nats_url
    from kvmesh.shared.config.nats_options import split_nats_urls

    first = split_nats_urls(url)[0]
    host, port = parse_nats_url(first)
    vet_foreign_server(
        host,
        port,
        insecure=insecure,
        has_credentials=has_credentials,
        tls=tls or first.startswith("tls://"),
        trust_network=trust_network,
    )
