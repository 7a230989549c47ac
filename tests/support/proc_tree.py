"""Process-tree checks for launcher tests, straight from /proc (no psutil)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                children.setdefault(stat[1], []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")  # zombies are dead, just not reaped


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def wait_all_dead(pids: set[int], timeout_s: float) -> set[int]:
    """Poll until every pid is gone; returns the survivors (empty on success)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = {p for p in pids if is_alive(p)}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@contextlib.contextmanager
def reaped(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``proc``, killed and waited for on the way out if it is still running (a test that failed
    before stopping it leaves no process behind)."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
