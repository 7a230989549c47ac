"""The share of CPU time a virtual machine's hypervisor took away (``steal`` in /proc/stat)
between two readings: on a shared host, what slowed a measurement that nothing on the machine
itself explains.

On this 2-core VM the validation's repeats (``kvmesh sim --validate``) run at speeds that differ
by up to half from one minute to the next, with nothing else running; ``vmstat`` shows steal of
0-15 % meanwhile. ``kvmesh sim --validate`` reads it around each repeat's probes and its
workload, so that a repeat slowed during its workload but not during its probes says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative jiffies of all CPUs: everything, and the stolen part of it."""

    total: int
    steal: int

    @classmethod
    def parse(cls, text: str) -> CpuTimes:
        """The aggregate ``cpu`` line of /proc/stat: user nice system idle iowait irq softirq
        steal [guest guest_nice]; guest time is already counted in user and nice."""
        for line in text.splitlines():
            fields = line.split()
            if fields and fields[0] == "cpu":
                values = [int(v) for v in fields[1:9]]
                if len(values) < 8:
                    raise ValueError(f"/proc/stat's cpu line has no steal field: {line!r}")
                return cls(sum(values), values[7])
        raise ValueError("/proc/stat has no aggregate cpu line")


def read_cpu_times(path: Path = PROC_STAT) -> CpuTimes | None:
    """Now's cumulative CPU times; None where there is no /proc/stat (not Linux)."""
    try:
        return CpuTimes.parse(path.read_text())
    except (OSError, ValueError):
        return None


def steal_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The stolen share of all CPU time between two readings; None without both, or when no
    time passed."""
    return steal_share_over([(before, after)])


def steal_share_over(spans: list[tuple[CpuTimes | None, CpuTimes | None]]) -> float | None:
    """The stolen share of all CPU time over several spans (each a before and after reading)
    together; None if a reading is missing or no time passed."""
    if any(a is None or b is None for a, b in spans):
        return None
    total = sum(b.total - a.total for a, b in spans)  # type: ignore[union-attr]
    steal = sum(b.steal - a.steal for a, b in spans)  # type: ignore[union-attr]
    return steal / total if total > 0 else None
