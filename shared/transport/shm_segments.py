"""The /dev/shm segments of the shm backend (shm.py) and what a writer checks before it maps one.

A descriptor is data from the network: it names segments, never paths, and a notification socket
whose folder and file this user owns (no symlinks). A receiver's segments are named
``kvmesh-<pid>-<8 hex>-<n>`` (its region table ``...-table``), so those of dead pids are swept.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat

import torch
from kvmesh.shared.config.huge_pages import advise_huge_pages
from kvmesh.shared.config.stale_dirs import sweep_dead_owner_files
from kvmesh.shared.transport.errors import PeerUnreachableError

SHM_DIR = "/dev/shm"

# Names a peer may ask us to map: "kvmesh-<pid>-<8 hex>-table" or "kvmesh-<pid>-<8 hex>-<n>".
# A descriptor is data from the network: it names segments, never paths (no separators, no "..").
SEGMENT_NAME = re.compile(r"kvmesh-[0-9]{1,10}-[0-9a-f]{8}-(?:table|[0-9]{1,6})")
SOCKET_NAME = "notify.sock"


class UntrustedDescriptorError(PeerUnreachableError):
    """A descriptor names something kvmesh did not create: a path instead of a segment name, a
    file of another user, a symlink. Nothing was opened for writing."""


def segment_token(name: str) -> str:
    """``kvmesh-<pid>-<hex>`` of a valid segment name (the transport that created it)."""
    return name.rsplit("-", 1)[0]


def check_segment_name(name: object) -> str:
    """``name`` if it is a kvmesh segment name; UntrustedDescriptorError otherwise."""
    if not isinstance(name, str) or SEGMENT_NAME.fullmatch(name) is None:
        raise UntrustedDescriptorError(
            f"shm segment name {name!r} is not a kvmesh segment (kvmesh-<pid>-<hex>-<n>); "
            "descriptors name segments, never paths"
        )
    return name


def _check_own_file(st: os.stat_result, what: str, kind: int) -> None:
    if stat.S_IFMT(st.st_mode) != kind:
        raise UntrustedDescriptorError(f"{what} is not a {stat.filemode(kind)[0]!r}-type file")
    if st.st_uid != os.geteuid():
        raise UntrustedDescriptorError(
            f"{what} belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()}); "
            "kvmesh maps only segments its own user created"
        )


def check_socket_path(path: object) -> str:
    """``path`` if it is a receiver's notification socket: ``<dir>/kvmesh-*/notify.sock``,
    normalized, with no symlink in its last two parts, both owned by this user."""
    if not isinstance(path, str) or not os.path.isabs(path) or os.path.normpath(path) != path:
        raise UntrustedDescriptorError(f"shm socket {path!r} is not a normalized absolute path")
    folder, name = os.path.split(path)
    if name != SOCKET_NAME or not os.path.basename(folder).startswith("kvmesh-"):
        raise UntrustedDescriptorError(
            f"shm socket {path!r} is not a kvmesh notification socket (kvmesh-*/{SOCKET_NAME})"
        )
    try:
        _check_own_file(os.lstat(folder), f"shm socket folder {folder!r}", stat.S_IFDIR)
        _check_own_file(os.lstat(path), f"shm socket {path!r}", stat.S_IFSOCK)
    except FileNotFoundError as exc:
        raise PeerUnreachableError(f"shm socket {path!r} does not exist: {exc}") from exc
    return path


def map_segment(name: str, create_bytes: int = 0) -> mmap.mmap:
    path = os.path.join(SHM_DIR, check_segment_name(name))
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_CREAT | os.O_EXCL if create_bytes else 0
    fd = os.open(path, flags, 0o600)
    try:
        if create_bytes:
            os.ftruncate(fd, create_bytes)
        else:
            _check_own_file(os.fstat(fd), f"shm segment {name!r}", stat.S_IFREG)
        size = os.fstat(fd).st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    finally:
        os.close(fd)


def sweep_stale_segments() -> list[str]:
    """Unlink this user's segments of kvmesh processes that died without closing (SIGKILL, OOM):
    their pools would otherwise pin host memory until reboot. Names carry the creator's pid."""
    return sweep_dead_owner_files(SHM_DIR, "kvmesh-")


def close_mapping(mm: mmap.mmap) -> None:
    # Viewed through mapping_tensor (a writer's copy in flight): unmapped with its last view.
    # A plain torch.frombuffer view holds no export: it is unmapped now, under the view.
    with contextlib.suppress(BufferError):
        mm.close()


class ShmSegment:
    __slots__ = ("addr", "mm", "name", "size", "tensor")

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        self.mm = map_segment(name, size)
        advise_huge_pages(self.mm, 0, size)  # honoured where shmem_enabled allows (advise)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)  # (size,)
        self.addr = self.tensor.data_ptr()
