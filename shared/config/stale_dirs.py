"""Folders and files named for the process that made them (``<prefix><pid>-<random>``), and the
sweep that removes those whose process died without cleaning up (SIGKILL, OOM): a shm receiver's
socket folder, a nats-server's config and store, a shm transport's segments. Without it each
killed process leaves one behind. Only this user's entries are swept: another user's are neither
ours to judge (their pid may live in another pid namespace) nor, in a sticky /dev/shm, to remove."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Callable


def owner_is_dead(pid: str) -> bool:
    """True only when no process ``pid`` exists (a live one, or one not ours to signal, is not)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return False


def make_owned_dir(
    prefix: str, parent: str | None = None, only: frozenset[str] | None = None
) -> str:
    """A fresh private folder ``<parent>/<prefix><this pid>-<random>`` (0700), after sweeping
    the stale ones of ``prefix`` there (``only``: as ``sweep_dead_owners``)."""
    parent = parent or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    sweep_dead_owners(parent, prefix, only)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def sweep_dead_owners(parent: str, prefix: str, only: frozenset[str] | None = None) -> list[str]:
    """Remove ``parent``'s folders ``<prefix><pid>-*`` that this user owns and whose pid is gone
    (``only``: and that hold no other names than these). Their names, removed."""

    def remove(folder: str) -> bool:
        if only is not None and set(os.listdir(folder)) - only:
            return False
        shutil.rmtree(folder)
        return True

    return _sweep(parent, prefix, stat.S_ISDIR, remove)


def sweep_dead_owner_files(parent: str, prefix: str) -> list[str]:
    """Remove ``parent``'s regular files ``<prefix><pid>-*`` that this user owns and whose pid is
    gone (a shm transport's segments in /dev/shm). Their names, removed."""

    def remove(path: str) -> bool:
        os.unlink(path)
        return True

    return _sweep(parent, prefix, stat.S_ISREG, remove)


def _sweep(
    parent: str, prefix: str, is_kind: Callable[[int], bool], remove: Callable[[str], bool]
) -> list[str]:
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid, sep, _ = name.removeprefix(prefix).partition("-")
        if not name.startswith(prefix) or not sep or not pid.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
            if not is_kind(st.st_mode) or st.st_uid != os.geteuid() or not owner_is_dead(pid):
                continue
            if remove(path):
                removed.append(name)
        except OSError:
            continue  # gone meanwhile, or not ours to remove
    return removed
