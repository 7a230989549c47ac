"""How ``kvmesh up`` shares a machine's CPU cores between its worker pools, and why.

On a CPU-only machine prefill and decode workers run on the same cores. Prefill is
compute-bound throughput work, decode latency-critical; the ways to keep prefill off decode's
back (docs/load.md, "Cores") are:

- ``priority``: work-conserving priority. Decode workers get every core as threads, and their
  OpenMP threads sleep when idle (``OMP_WAIT_POLICY=PASSIVE``); prefill workers run at
  ``SCHED_IDLE`` (or at ``--prefill-nice`` N), their autogroup at the same low weight, so a
  decode step takes the cores the moment it is runnable and prefill uses every cycle left;
- ``partition``: hard partitioning. Decode workers are pinned to a third of the cores (at
  least one), prefill workers to the rest, as each pool owns its GPUs in a real deployment.
  A single prefill worker also borrows decode's cores for an engine step while every decode
  worker is idle (``--borrow-cpus``, services/prefill/core_loan.py): a decode worker gains
  streams from prefill's deliveries (and rarely a local prefill), so an idle decode almost
  always stays idle through that step. ``partition-strict`` never borrows. ``partition-spare``
  makes the last of two or more prefill workers a spare: one unpinned thread at ``SCHED_IDLE``
  that computes on whatever core the others leave idle, decode's included;
- ``equal``: the earlier split at equal priority: prefill threads on every core, decode threads
  on a third, the kernel sharing them out.

``auto`` picks ``partition`` for a disaggregated mesh on the CPU: of the two honest ways it
gave the better goodput on the issue #29 workload, open loop and closed (docs/load.md has the
runs). ``--prefill-nice`` asks for ``priority`` at that nice level. With GPUs (``--device``
other than cpu) the cores only feed the devices, and on one core there is nothing to
partition: the split stays ``equal``. Colocated workers do both jobs and share every core.

``plan_cpus`` is pure: the cores it may use come in, the threads, CPU lists, priorities and
environment of each role come out, with the reason in words for ``kvmesh up`` to print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.shared.config.cpu_placement import format_cpu_list

Sharing = Literal["auto", "priority", "partition", "partition-strict", "partition-spare", "equal"]
SHARINGS: tuple[str, ...] = (
    "auto",
    "priority",
    "partition",
    "partition-strict",
    "partition-spare",
    "equal",
)
PASSIVE = (("OMP_WAIT_POLICY", "PASSIVE"),)
SPARE = "prefill-spare"  # partition-spare: the last prefill worker, on idle cycles of any core


@dataclass(frozen=True, slots=True)
class RolePlan:
    """What every worker of one role gets."""

    threads: int
    cpus: frozenset[int] = frozenset()  # empty: not pinned
    nice: int = 0
    idle: bool = False  # SCHED_IDLE
    env: tuple[tuple[str, str], ...] = ()
    borrow: frozenset[int] = frozenset()  # cores it also computes on while decode is idle

    def flags(self) -> tuple[str, ...]:
        """The worker's ``kvmesh serve`` flags for it (threads included)."""
        out: tuple[str, ...] = ("--threads", str(self.threads))
        if self.cpus:
            out += ("--cpus", format_cpu_list(self.cpus))
        if self.nice:
            out += ("--nice", str(self.nice))
        if self.idle:
            out += ("--sched-idle",)
        if self.borrow:
            out += ("--borrow-cpus", format_cpu_list(self.borrow))
        return out

    def describe(self) -> str:
        parts = [f"{self.threads} thread{'s' if self.threads != 1 else ''}"]
        if self.cpus:
            parts.append(f"on CPUs {format_cpu_list(self.cpus)}")
        if self.idle:
            parts.append("SCHED_IDLE")
        elif self.nice:
            parts.append(f"nice {self.nice}")
        if self.borrow:
            parts.append(f"borrowing CPUs {format_cpu_list(self.borrow)} while decode is idle")
        return " ".join(parts)


@dataclass(frozen=True, slots=True)
class CpuPlan:
    sharing: str  # what auto resolved to
    roles: dict[str, RolePlan]  # "decode"/"prefill" (and SPARE), or "colocated"
    why: str

    def threads(self) -> dict[str, int]:
        return {role: p.threads for role, p in self.roles.items()}

    def describe(self) -> str:
        roles = "; ".join(f"{role}: {p.describe()}" for role, p in self.roles.items())
        return f"CPU sharing {self.sharing} ({roles}): {self.why}"


def plan_cpus(
    cpus: frozenset[int],
    *,
    mode: str,
    device: str,
    decode_workers: int,
    prefill_workers: int,
    sharing: str = "auto",
    prefill_nice: int = 0,
    pinnable: bool = True,
) -> CpuPlan:
    """Each role's share of ``cpus`` (the cores the workers may use); ``pinnable``: they are
    CPUs this process may run on (not when ``--cores`` asked for more than it has)."""
    if sharing not in SHARINGS:
        raise ValueError(f"cpu_sharing must be one of {', '.join(SHARINGS)}, got {sharing!r}")
    cores = len(cpus)
    assert cores >= 1 and decode_workers >= 1
    if mode == "colocated":
        threads = max(1, cores // decode_workers)
        why = "colocated workers prefill and decode alike: they share every core"
        return CpuPlan("equal", {"colocated": RolePlan(threads)}, why)
    assert prefill_workers >= 1
    if sharing == "auto":
        if device != "cpu":
            sharing, why = "equal", f"workers on {device}: the cores only feed the devices"
        elif prefill_nice:
            sharing, why = "priority", f"--prefill-nice {prefill_nice} asks for priority"
        elif cores == 1:
            sharing, why = "equal", "one core: nothing to partition"
        else:
            sharing = "partition"
            why = (
                "prefill and decode would share these cores: each pool gets cores of its own, "
                "so prefill never delays a decode step and decode never stalls prefill's "
                "threads (better goodput than priority on the CPU, docs/load.md); one prefill "
                "worker also computes on decode's cores while decode is idle"
            )
    else:
        why = "as asked (--cpu-sharing)"
    if sharing.startswith("partition") and not pinnable:
        sharing = "equal"
        why = f"--cores {cores} is more CPUs than this process may run on: none to pin"
    if sharing == "priority":
        decode = RolePlan(max(1, cores // decode_workers), env=PASSIVE)
        prefill = RolePlan(
            max(1, cores // prefill_workers), nice=prefill_nice, idle=not prefill_nice
        )
    elif sharing.startswith("partition"):
        ordered = sorted(cpus)
        num_decode = max(1, cores // 3) if cores > 1 else 1
        decode_cpus = frozenset(ordered[cores - num_decode :])
        prefill_cpus = frozenset(ordered[: cores - num_decode]) or decode_cpus
        decode = RolePlan(max(1, len(decode_cpus) // decode_workers), decode_cpus)
        with_spare = sharing == "partition-spare" and prefill_workers > 1
        pinned = prefill_workers - 1 if with_spare else prefill_workers
        # one prefill worker borrows decode's cores while decode is idle (core_loan.py): with
        # several, another's delivery could start a stream on them during its step
        borrow = (
            decode_cpus - prefill_cpus
            if sharing == "partition" and prefill_workers == 1
            else frozenset()
        )
        prefill = RolePlan(max(1, len(prefill_cpus) // pinned), prefill_cpus, borrow=borrow)
        if with_spare:
            # the last prefill worker is a spare: one thread on any core, at SCHED_IDLE, so it
            # computes a job on whatever core the others leave idle, decode's included
            spare = RolePlan(1, idle=True)
            return CpuPlan(sharing, {"decode": decode, "prefill": prefill, SPARE: spare}, why)
    else:
        decode_cores = cores if prefill_nice else max(1, cores // 3)
        decode = RolePlan(
            max(1, decode_cores // decode_workers), env=PASSIVE if prefill_nice else ()
        )
        prefill = RolePlan(max(1, cores // prefill_workers), nice=prefill_nice)
    return CpuPlan(sharing, {"decode": decode, "prefill": prefill}, why)
