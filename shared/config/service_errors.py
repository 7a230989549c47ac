"""Errors that stop a command for a reason its operator can fix: a port already taken, an address
that is not this machine's. ``kvmesh serve`` and ``kvmesh up`` print them as one line that says
what to do, and exit 1, without a traceback.
"""

from __future__ import annotations

import errno
import socket


class ServiceStartError(RuntimeError):
    """A service cannot start; the message names the cause and the flag to change."""


def listen_error(host: str, port: int, exc: OSError) -> ServiceStartError:
    """What an ``OSError`` from binding ``host:port`` means for whoever chose them."""
    if isinstance(exc, socket.gaierror):
        return ServiceStartError(
            f"cannot listen on {host}:{port}: {host!r} is not a host name or address ({exc}); "
            "use --host 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        )
    if exc.errno == errno.EADDRINUSE:
        return ServiceStartError(
            f"port {port} on {host} is already in use (another kvmesh router, or another "
            "program); choose a free one with --port (0 picks one), or stop what holds it "
            f"(`ss -ltnp 'sport = :{port}'` shows it)"
        )
    if exc.errno == errno.EACCES:
        return ServiceStartError(
            f"no permission to listen on port {port} (ports below 1024 need privileges); "
            "choose a port from 1024 up with --port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return ServiceStartError(
            f"cannot listen on {host}: it is not an address of this machine; use --host "
            "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        )
    return ServiceStartError(f"cannot listen on {host}:{port}: {exc.strerror or exc}")


def check_can_listen(host: str, port: int) -> None:
    """Raise ``ServiceStartError`` when a server could not listen on ``host:port`` now (port 0:
    any port, so only the host is checked). Binds as asyncio servers do (SO_REUSEADDR), so a
    port in TIME_WAIT counts as free."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=0)
    except socket.gaierror as exc:
        raise listen_error(host, port, exc) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise listen_error(host, port, exc) from None


def find_error(exc: BaseException, types: tuple[type[BaseException], ...]) -> BaseException | None:
    """``exc`` if it is one of ``types``, else the first such member of it as an exception group
    (a TaskGroup wraps what its tasks and its body raise), else None."""
    if isinstance(exc, types):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for member in exc.exceptions:
            found = find_error(member, types)
            if found is not None:
                return found
    return None
