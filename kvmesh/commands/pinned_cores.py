"""The cores the workers of other meshes on this machine are pinned to, so that ``kvmesh up``
pins its own elsewhere, or says that it cannot (issue 45: two meshes on one host both pinned
their decode workers to CPU 1, each planning as if it had the machine to itself).

A pinned worker is a ``kvmesh serve`` process started with ``--cpus LIST`` (cpu_plan.py's
``partition``): its command line says its mesh, its worker id and its cores, and every user may
read it in ``/proc/<pid>/cmdline`` as ``ps`` does (serve_processes.py). So the claim on a core is the process itself:
nothing to write, nothing stale after a crash, other users' meshes seen too. The launcher reads
them once, before it plans and starts its own workers (``cpu_plan(config, taken)`` in
up_plan.py); two ``kvmesh up`` started within the same few milliseconds can still miss each
other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvmesh.commands.serve_processes import (
    PROC,
    ServeCommand,
    serve_command,
    serve_processes,
)
from kvmesh.shared.config.cpu_placement import format_cpu_list, parse_cpu_list


@dataclass(frozen=True, slots=True)
class PinnedWorker:
    pid: int
    mesh: str
    worker_id: str
    cpus: frozenset[int]

    def describe(self) -> str:
        return f"{self.worker_id} of mesh {self.mesh!r} (pid {self.pid})"


def parse_worker(pid: int, argv: Sequence[str]) -> PinnedWorker | None:
    """The pinned kvmesh worker ``argv`` starts, or None (not kvmesh serve, or not pinned)."""
    command = serve_command(pid, argv)
    return None if command is None else _pinned(command)


def pinned_workers(proc: Path = PROC) -> list[PinnedWorker]:
    """Every pinned kvmesh worker running on this machine (none where /proc is not Linux's)."""
    return [w for w in map(_pinned, serve_processes(proc)) if w is not None]


def _pinned(command: ServeCommand) -> PinnedWorker | None:
    try:
        cpus = parse_cpu_list(command.flags["--cpus"])
    except (KeyError, ValueError):  # not pinned
        return None
    return PinnedWorker(command.pid, command.mesh, command.worker_id, cpus)


def taken_cores(workers: Iterable[PinnedWorker]) -> frozenset[int]:
    return frozenset(cpu for w in workers for cpu in w.cpus)


def pinning_note(planned: frozenset[int], others: Sequence[PinnedWorker]) -> str:
    """One line for ``kvmesh up`` to print: where this mesh pins, against others' pins ("" when
    no other mesh pins a core here)."""
    if not others:
        return ""
    shared = [w for w in others if w.cpus & planned]
    if not shared:
        return (
            f"CPUs {format_cpu_list(taken_cores(others))} are pinned by "
            f"{', '.join(w.describe() for w in others)}; this mesh pins its workers to CPUs "
            f"{format_cpu_list(planned)}"
        )
    both = taken_cores(shared) & planned
    return (
        f"warning: CPUs {format_cpu_list(both)} are pinned by "
        f"{', '.join(w.describe() for w in shared)} too, and too few cores are free here to give "
        "this mesh cores of its own: the two meshes' workers share them, so neither runs as "
        "planned (start one mesh per set of cores: taskset -c LIST kvmesh up ..., or "
        "--cpu-sharing equal)"
    )
