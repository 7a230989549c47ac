"""Whether a folder or a file on disk can be trusted with code this process will run.

A compiled kernel library is loaded into the process: whoever can write it, or swap the folder
it lies in, runs code as kvmesh's user (issue 40: another local user planted a library in
``/tmp/kvmesh-cache-0/`` and a root ``kvmesh generate`` ran its constructor). So, as sshd's
``StrictModes`` does, a path is trusted only when no one but this user (and root) can change it:

- every folder from ``/`` down to it is owned by this user or root and writable by no one else,
  except root's sticky folders (``/tmp``), where others cannot rename or remove what is ours;
- the folder itself is ours, a real folder (not a link) and ``0700``;
- a file in it is ours, a regular file (not a link) and writable by no one else.

The folders above are walked from ``/`` one ``O_NOFOLLOW`` open at a time, each checked on its
open fd; a link on the way is followed only when root's or ours (``open_parent``, which the
kv-store's ``--disk-path`` uses too: one walk for every caller). The last step is ``lstat``ed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class UntrustedPathError(OSError):
    """A path some other user can change; the message says which part and why."""


def _who(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # as the kernel's ELOOP


def _check_folder(st: os.stat_result, shown: str) -> None:
    """A folder on the way to a path: root's or this user's, writable by no one else unless it
    is root's and sticky (``/tmp``: others may not rename or remove what is not theirs)."""
    if st.st_uid not in (0, os.geteuid()):
        raise UntrustedPathError(
            f"{shown} above it is owned by uid {st.st_uid} ({_who(st.st_uid)}), who could swap "
            "what is below it; use a path whose every folder is root's or this user's"
        )
    if st.st_mode & 0o022 and not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
        raise UntrustedPathError(
            f"{shown} above it is writable by other users (mode {stat.S_IMODE(st.st_mode):o}), "
            f"who could swap what is below it; chmod go-w {shown}"
        )


def _open_folder(path: str, *, missing_ok: bool) -> int | None:
    """An ``O_NOFOLLOW`` fd of folder ``path`` (absolute), reached from ``/`` one open at a time
    relative to the last, each folder checked on its fd (``_check_folder``), so none is a link
    or swapped when it is checked. A link on the way is followed only if it is root's or this
    user's (its folder is checked: no one else can replace it), and its target is walked the same
    way. A missing folder gives None with ``missing_ok`` (the rest will be made by us), else
    UntrustedPathError as for every other refusal."""
    stack: list[tuple[int, str]] = []  # the open folders from "/" down, and how they are shown
    try:
        stack.append((os.open("/", _DIR_FLAGS), "/"))
        _check_folder(os.fstat(stack[0][0]), "/")
        todo = [part for part in path.split("/") if part]
        links = 0
        while todo:
            part = todo.pop(0)
            if part == ".":
                continue
            if part == "..":
                if len(stack) > 1:
                    os.close(stack.pop()[0])
                continue
            dir_fd, shown = stack[-1]
            here = os.path.join(shown, part)
            try:
                st = os.stat(part, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                if missing_ok:
                    return None
                raise UntrustedPathError(f"{here}: no such folder") from None
            if stat.S_ISLNK(st.st_mode):
                if st.st_uid not in (0, os.geteuid()):
                    raise UntrustedPathError(
                        f"{here} is a link owned by uid {st.st_uid} ({_who(st.st_uid)})"
                    )
                links += 1
                if links > MAX_LINKS:
                    raise UntrustedPathError(f"{path}: more than {MAX_LINKS} links on the way")
                target = os.readlink(part, dir_fd=dir_fd)
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop()[0])
                todo = [p for p in target.split("/") if p] + todo
                continue
            try:
                fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise UntrustedPathError(
                    f"cannot open {here}: {exc.strerror} (not a folder, or changed while checked?)"
                ) from None
            stack.append((fd, here))
            _check_folder(os.fstat(fd), here)
        return stack.pop()[0]
    finally:
        for fd, _ in stack:
            os.close(fd)


def open_parent(path: str | Path) -> tuple[int, str]:
    """An fd of the folder ``path`` is in (every folder from ``/`` down to it checked, see
    ``_open_folder``) and ``path``'s last name, for the caller to open relative to that fd
    (``O_NOFOLLOW``: then nothing between the check and the use can redirect it). The caller
    closes the fd. UntrustedPathError says which folder is not trusted, or missing, and why."""
    parent, name = os.path.split(os.path.abspath(path))
    if not name:
        raise UntrustedPathError(f"{path} is the root folder")
    fd = _open_folder(parent, missing_ok=False)
    assert fd is not None
    return fd, name


def check_ancestors(path: str | Path) -> None:
    """Every folder above ``path`` is owned by this user or root and writable by no one else
    (root's sticky folders excepted), walked as ``open_parent`` walks it; the folders not made
    yet will be ours. UntrustedPathError naming the first that is not trusted."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        fd = _open_folder(parent, missing_ok=True)
    except UntrustedPathError as exc:
        raise UntrustedPathError(f"{path}: {exc}") from None
    if fd is not None:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """``path`` made (``0700``) or checked: ours, a real folder, ``0700`` (one of ours that is
    looser is tightened), and every folder above it trusted. UntrustedPathError otherwise."""
    check_ancestors(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedPathError(f"{path} is not a folder (a link or a file)")
    if st.st_uid != os.geteuid():
        raise UntrustedPathError(f"{path} is owned by {_who(st.st_uid)}, not by this user")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700, follow_symlinks=False)
    return path


def trusted_file(path: Path) -> bool:
    """Whether ``path`` exists as a regular file of ours that no one else can write. A file
    there that is not (a link, another user's, group- or world-writable) raises
    UntrustedPathError; a missing one is False."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedPathError(f"{path} is not a regular file (a link or something else)")
    if st.st_uid != os.geteuid():
        raise UntrustedPathError(f"{path} is owned by {_who(st.st_uid)}, not by this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPathError(f"{path} is writable by others (mode {st.st_mode & 0o777:o})")
    return True


def fresh_private_dir(prefix: str) -> Path:
    """A new folder only this process knows of (``mkdtemp``: ``0700``, a random name)."""
    return Path(tempfile.mkdtemp(prefix=prefix))
