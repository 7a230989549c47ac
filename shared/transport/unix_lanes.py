"""Same-host tcp lanes over a unix socket, with the peer's uid checked (issue 40).

A tcp receiver also listens on ``<dir>/lanes.sock``, ``dir`` a fresh private folder
(``kvmesh-lanes-<pid>-<random>``, 0700: only its user and root can reach the socket) and
advertises its path in its descriptor (``TcpBackend.unix``). The receiver reads the kernel's
record of who connected (``SO_PEERCRED``) at accept: a peer whose effective uid is neither its
own nor root's is reset before any byte is sent or read, whatever the folder's mode. A lane that
passes still proves it knows the descriptor's secret (``lane_auth``), as over TCP.

A writer takes the socket only when the descriptor is of its own host (``host_id``) and the
path is a kvmesh lane socket in a folder that it owns, both its own user's (so no other user
can stand in for the receiver); else, or when the socket cannot be reached, it dials TCP, which
stays the cross-host path and the fallback. Connections over the socket skip the per-source
accept budgets (one source, reachable by one user).
"""

from __future__ import annotations

import os
import socket
import stat
import struct

from kvmesh.shared.config.stale_dirs import make_owned_dir
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.transport.base import local_host_id

SOCKET_NAME = "lanes.sock"
DIR_PREFIX = "kvmesh-lanes-"
_UCRED = struct.Struct("3i")  # pid, uid, gid


def listen(parent: str | None) -> tuple[str, socket.socket]:
    """A fresh private folder under ``parent`` (default: the temp folder; stale ones of dead
    pids swept first) and a listening unix socket in it: (the socket's path, the listener)."""
    folder = make_owned_dir(DIR_PREFIX, parent, only=frozenset({SOCKET_NAME}))
    path = os.path.join(folder, SOCKET_NAME)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return path, listener


def peer_uid(conn: socket.socket) -> int:
    """The effective uid of the process that connected ``conn`` (``SO_PEERCRED``)."""
    _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def refuse_other_users(conn: socket.socket) -> str | None:
    """Why ``conn`` is refused (a peer of another uid than ours or root's), or None."""
    uid = peer_uid(conn)
    if uid in (os.geteuid(), 0):
        return None
    return f"peer uid {uid} is neither this process's ({os.geteuid()}) nor root"


def _owned(path: str, kind: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.geteuid()


def local_path(descriptor: TransportDescriptor, info: TcpBackend) -> str | None:
    """The unix socket to reach ``info``'s receiver by, or None (dial TCP): the peer is on this
    host, and the advertised path is a kvmesh lane socket, normalized, whose folder and socket
    are this user's own (not links)."""
    path = info.unix
    if path is None or descriptor.host_id != local_host_id():
        return None
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        return None
    folder, name = os.path.split(path)
    if name != SOCKET_NAME or not os.path.basename(folder).startswith(DIR_PREFIX):
        return None
    if not (_owned(folder, stat.S_IFDIR) and _owned(path, stat.S_IFSOCK)):
        return None
    return path


__all__ = ["SOCKET_NAME", "listen", "local_path", "peer_uid", "refuse_other_users"]
