"""Whether a folder or a file on disk can be trusted with code this process will run.

A compiled kernel library is loaded into the process: whoever can write it, or swap the folder
it lies in, runs code as kvmesh's user (issue 40: another local user planted a library in
``/tmp/kvmesh-cache-0/`` and a root ``kvmesh generate`` ran its constructor). So, as sshd's
``StrictModes`` does, a path is trusted only when no one but this user (and root) can change it:

- every folder from ``/`` down to it is owned by this user or root and writable by no one else,
  except a sticky folder (``/tmp``), where others cannot rename or remove what is ours;
- the folder itself is ours, a real folder (not a link) and ``0700``;
- a file in it is ours, a regular file (not a link) and writable by no one else.

Nothing here follows a link: each step is ``lstat``ed.
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


def check_ancestors(path: Path) -> None:
    """Every folder above ``path`` is owned by this user or root and writable by no one else
    (sticky folders excepted); UntrustedPathError naming the first that is not."""
    me = os.geteuid()
    for parent in reversed(Path(os.path.abspath(path)).parents):
        try:
            st = os.lstat(parent)
        except FileNotFoundError:  # the rest is not made yet: it will be ours
            return
        if stat.S_ISLNK(st.st_mode):
            # a link we did not make: its target may belong to anyone
            if st.st_uid not in (me, 0):
                raise UntrustedPathError(f"{parent} is a link owned by {_who(st.st_uid)}")
            check_ancestors(parent.resolve())
            continue
        if st.st_uid not in (me, 0):
            raise UntrustedPathError(f"{parent} is owned by {_who(st.st_uid)}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            raise UntrustedPathError(
                f"{parent} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
            )


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
