"""Where an engine worker's threads run and at what priority, set once as it starts.

Two honest ways keep prefill (throughput work) off decode's back (latency work) where both
share a machine's cores (docs/load.md, "Cores"):

- hard partitioning: each pool runs on cores of its own (``cpus``, sched_setaffinity), as each
  pool owns its GPUs in a real deployment;
- work-conserving priority: prefill runs at ``SCHED_IDLE`` (``idle``) or ``nice`` N, so a
  decode step that becomes runnable takes a core at once and prefill uses every idle cycle.

Priority has a trap on Linux: with ``/proc/sys/kernel/sched_autogroup_enabled`` = 1 the
scheduler first shares the CPU between sessions (``kvmesh up`` starts every service in a
session of its own) at equal weight, and a thread's nice or policy only counts against threads
of its own session. A nice'd prefill worker then still got half the cores against decode. So a
lower priority here also lowers the worker's autogroup (``/proc/self/autogroup``: nice 19 for
``SCHED_IDLE``, else the worker's nice), which is what makes it hold against other services.

Everything is applied to the calling thread before the worker starts any other (torch's and
OpenMP's pools, asyncio's executor): new threads inherit affinity, policy and nice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

AUTOGROUP = Path("/proc/self/autogroup")
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8} (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: expected a list like 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"CPU list {text!r} names no CPU")
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 5} -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


@dataclass(frozen=True, slots=True)
class CpuPlacement:
    """``cpus``: empty for wherever the process may run now; ``nice``: 0-19; ``idle``:
    SCHED_IDLE (below every nice level)."""

    cpus: frozenset[int] = frozenset()
    nice: int = 0
    idle: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must be in [0, 19] (a lower priority only), got {self.nice}")

    @property
    def autogroup_nice(self) -> int:
        """The niceness the worker's autogroup takes (0: left alone)."""
        return 19 if self.idle else self.nice

    def apply(self, autogroup: Path = AUTOGROUP) -> list[str]:
        """Set this process's affinity and priority; returns what was done, for the log. A CPU
        list naming no CPU this process may use is an error that says which it may."""
        done = []
        if self.cpus:
            allowed = os.sched_getaffinity(0)
            if not self.cpus & allowed:
                raise ValueError(
                    f"--cpus {format_cpu_list(self.cpus)} names none of the CPUs this process may "
                    f"run on ({format_cpu_list(allowed)})"
                )
            os.sched_setaffinity(0, self.cpus & allowed)
            done.append(f"cpus {format_cpu_list(self.cpus & allowed)}")
        if self.nice:
            os.nice(self.nice)
            done.append(f"nice {self.nice}")
        if self.idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            done.append("SCHED_IDLE")
        if self.autogroup_nice and autogroup_enabled():
            try:
                autogroup.write_text(str(self.autogroup_nice))
            except OSError as exc:  # e.g. a kernel without autogroup: the nice applies as is
                done.append(f"autogroup left alone ({exc.strerror})")
            else:
                done.append(f"autogroup nice {self.autogroup_nice}")
        return done


def autogroup_enabled(path: Path = AUTOGROUP_ENABLED) -> bool:
    """Whether the kernel groups threads by session before it weighs their nice."""
    try:
        return path.read_text().strip() == "1"
    except OSError:
        return False
