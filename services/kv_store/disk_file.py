"""The kv-store's disk file: a preallocated file of slots, each a block then its 64-byte header,
read and written with ``os.preadv``/``os.pwritev`` (blocking: the service calls them in a worker
thread, never on the event loop).

The directory is the operator's (``--disk-path``, from config, never from a message); it must
exist, be a directory itself (not a symlink to one: it is opened with ``O_NOFOLLOW``), be owned
by the store's user and writable by nobody else (no group or other write bit: another user
could rename the file away during preallocation, which crashed the store and left a 1 GiB file
behind; issue 27), or the store refuses to start and says which. Every directory above it
is checked too, as sshd's StrictModes does (issue 40: only the last component was), by the walk
the kernel cache and kvmesh up's state folder share (shared/config/private_path.py
``open_parent``): each is owned by this user or root and writable by no one else, unless it is
root's and sticky (as ``/tmp``: others may not rename what is not theirs in it); it is walked
from ``/`` one ``O_NOFOLLOW`` open at a time, a symlink on the way followed only when root's or
ours, so no component is a symlink when it is checked. The checks are made on the opened
directories (``fstat``); the last is the one the file is created in. The file is the store's
own: created there with ``O_CREAT | O_EXCL | O_NOFOLLOW`` and mode 0600 under a fresh name
(``kvmesh-kv-store-<pid>-<hex>.blocks``), so it can be neither a planted file nor a symlink,
unlinked at once, then preallocated (a full disk fails the start, not a spill): its space
belongs to the open descriptor and goes back to the filesystem when the store process ends,
however it ends. A restarted store never reuses a file; it starts with an empty index and
a new file (docs/kv_store.md).
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from kvmesh.shared.config.private_path import UntrustedPathError, open_parent
from kvmesh.shared.config.service_errors import ServiceStartError
from kvmesh.shared.kv.kv_block_header import HEADER_BYTES

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _open_parent(path: str | Path) -> tuple[int, str]:
    """An fd of ``path``'s parent directory, every directory from ``/`` down to it checked on
    its fd (shared/config/private_path.py ``open_parent``, the walk every caller shares), and
    the last name; ServiceStartError saying which directory and what to do."""
    try:
        return open_parent(path)
    except UntrustedPathError as exc:
        raise ServiceStartError(f"--disk-path {path}: {exc}") from None


def open_disk_dir(path: str | Path) -> int:
    """An fd of directory ``path`` (not followed if a symlink) that is this user's own and
    writable by nobody else, under directories nobody else may change; else a
    ServiceStartError that says what is wrong and how to fix it. The caller closes it."""
    if not os.path.lexists(path):
        raise ServiceStartError(f"--disk-path {path}: no such directory")
    parent_fd, name = _open_parent(path)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        raise ServiceStartError(f"--disk-path {path}: no such directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(path):
            raise ServiceStartError(
                f"--disk-path {path}: a symlink; give the directory itself"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise ServiceStartError(f"--disk-path {path}: not a directory") from None
        raise ServiceStartError(f"--disk-path {path}: cannot open it: {exc.strerror}") from None
    finally:
        os.close(parent_fd)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ServiceStartError(
                f"--disk-path {path}: owned by uid {st.st_uid}, not by this user "
                f"(uid {os.geteuid()}); use a directory of the store's own user"
            )
        if st.st_mode & 0o022:
            raise ServiceStartError(
                f"--disk-path {path}: writable by other users (mode {st.st_mode & 0o777:o}); "
                f"chmod go-w it, or use a directory of the store's own (mode 700)"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_disk_dir(path: str) -> Path:
    """``path`` as an absolute directory of this user's that nobody else may write to (see
    ``open_disk_dir``); else a ServiceStartError that says what is wrong."""
    p = Path(path).expanduser().absolute()
    os.close(open_disk_dir(p))
    if not os.access(p, os.W_OK | os.X_OK):
        raise ServiceStartError(f"--disk-path {path}: not writable by this user")
    return p


class DiskFile:
    """``num_slots`` slots of ``block_bytes + HEADER_BYTES`` bytes in one unlinked file."""

    def __init__(self, fd: int, name: str, num_slots: int, block_bytes: int) -> None:
        self.fd = fd
        self.name = name  # the path it had before it was unlinked (for logs)
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.stride = block_bytes + HEADER_BYTES

    @classmethod
    def create(cls, directory: Path, num_slots: int, block_bytes: int) -> DiskFile:
        """A fresh file of ``num_slots`` slots under ``directory`` (see the module doc)."""
        name = f"kvmesh-kv-store-{os.getpid()}-{secrets.token_hex(4)}.blocks"
        size = num_slots * (block_bytes + HEADER_BYTES)
        dir_fd = open_disk_dir(directory)  # checked again: the directory the file goes in
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
            except OSError as exc:
                raise ServiceStartError(
                    f"--disk-path {directory}: cannot create {name}: {exc.strerror}"
                ) from None
            try:  # nameless before it takes its space: nothing to rename, nothing left behind
                os.unlink(name, dir_fd=dir_fd)
                _preallocate(fd, size)
            except OSError as exc:
                os.close(fd)
                raise ServiceStartError(
                    f"--disk-path {directory}: cannot make the disk tier's {size}-byte file: "
                    f"{exc.strerror}"
                ) from None
        finally:
            os.close(dir_fd)
        return cls(fd, str(directory / name), num_slots, block_bytes)

    def write_slot(self, slot: int, block: memoryview, header: memoryview) -> None:
        """Block and header of one host slot into disk slot ``slot`` (blocking)."""
        self._io(os.pwritev, slot, block, header)

    def read_slot(self, slot: int, block: memoryview, header: memoryview) -> None:
        """Disk slot ``slot`` into one host slot's block and header (blocking)."""
        self._io(os.preadv, slot, block, header)

    def _io(self, op, slot: int, block: memoryview, header: memoryview) -> None:
        assert 0 <= slot < self.num_slots, slot
        assert len(block) == self.block_bytes and len(header) == HEADER_BYTES
        offset, views = slot * self.stride, [block, header]
        want = self.stride
        while want:  # short transfers are legal; finish them
            n = op(self.fd, views, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"disk tier: slot {slot}: {op.__name__} moved 0 bytes")
            offset, want = offset + n, want - n
            views = _advance(views, n)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def _preallocate(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: a sparse file
