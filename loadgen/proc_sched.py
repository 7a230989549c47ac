"""CPU time used and time runnable-but-waiting of the processes a benchmark loads, by role.

Linux keeps, for every thread, the CPU time it ran and the time it sat on a run queue ready to
run but not running (``/proc/<pid>/task/<tid>/schedstat``: nanoseconds run, nanoseconds waited,
time slices). Summed over a process's threads and taken before and after a run, they say how
much of the cores each role used and how long its threads were ready but kept off a core: on
shared cores, the second is the time another role (or the load generator) held them.

Threads that ended between the two readings are missed (their time is gone from ``/proc``); the
workers' torch and OpenMP threads live as long as their process. A process that ended is left
out. ``pid_listening_on`` finds the process behind a server this benchmark did not start (e.g.
llama-server) by the TCP port it listens on, among the processes this user may read.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


@dataclass(frozen=True, slots=True)
class SchedTimes:
    """Seconds run on a CPU and seconds runnable but waiting for one, over some threads."""

    cpu_s: float = 0.0
    wait_s: float = 0.0

    def __add__(self, other: SchedTimes) -> SchedTimes:
        return SchedTimes(self.cpu_s + other.cpu_s, self.wait_s + other.wait_s)

    def __sub__(self, other: SchedTimes) -> SchedTimes:
        return SchedTimes(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s)


def parse_schedstat(text: str) -> SchedTimes:
    """One ``schedstat`` line: ``run_ns wait_ns slices``."""
    fields = text.split()
    if len(fields) < 2:
        raise ValueError(f"not a schedstat line: {text!r}")
    return SchedTimes(int(fields[0]) / 1e9, int(fields[1]) / 1e9)


def process_times(pid: int, proc: Path = PROC) -> SchedTimes | None:
    """The sum over ``pid``'s live threads; None when the process is gone or unreadable."""
    total = SchedTimes()
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            total += parse_schedstat((task / "schedstat").read_text())
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
    return total


def read_roles(roles: Mapping[str, Iterable[int]], proc: Path = PROC) -> dict[str, SchedTimes]:
    """Per role, the sum over its processes (those still alive)."""
    out = {}
    for role, pids in roles.items():
        times = [t for pid in pids if (t := process_times(pid, proc)) is not None]
        if times:
            out[role] = sum(times, SchedTimes())
    return out


def role_deltas(
    before: Mapping[str, SchedTimes], after: Mapping[str, SchedTimes]
) -> dict[str, SchedTimes]:
    """What each role used between two readings (roles read both times)."""
    return {role: after[role] - before[role] for role in after if role in before}


def listening_inodes(port: int, proc: Path = PROC) -> set[str]:
    """Socket inodes of TCP listeners on ``port`` (any address, IPv4 or IPv6)."""
    inodes = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def pid_listening_on(port: int, proc: Path = PROC) -> int | None:
    """The process listening on TCP ``port``, among those whose descriptors this user can read."""
    inodes = {f"socket:[{inode}]" for inode in listening_inodes(port, proc)}
    if not inodes:
        return None
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    return int(entry.name)
            except OSError:
                continue
    return None
