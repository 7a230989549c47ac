"""The cores the workers of other meshes on this machine are pinned to, so that ``kvmesh up``
pins its own elsewhere, or says that it cannot (issue 45: two meshes on one host both pinned
their decode workers to CPU 1, each planning as if it had the machine to itself).

A pinned worker is a ``kvmesh serve`` process started with ``--cpus LIST`` (cpu_plan.py's
``partition``): its command line says its mesh, its worker id and its cores, and every user may
read it in ``/proc/<pid>/cmdline`` as ``ps`` does. So the claim on a core is the process itself:
nothing to write, nothing stale after a crash, other users' meshes seen too. The launcher reads
them once, before it plans and starts its own workers (``cpu_plan(config, taken)`` in
up_plan.py); two ``kvmesh up`` started within the same few milliseconds can still miss each
other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

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
    if "serve" not in argv or "--cpus" not in argv:
        return None
    serve = argv.index("serve")
    if not any(part.endswith(("kvmesh", "kvmesh.cli")) for part in argv[:serve]):
        return None
    flags = dict(zip(argv[serve + 2 :], argv[serve + 3 :], strict=False))  # flag -> next word
    try:
        cpus = parse_cpu_list(flags["--cpus"])
    except (KeyError, ValueError):
        return None
    worker_id = flags.get("--worker-id", argv[serve + 1] if serve + 1 < len(argv) else "?")
    return PinnedWorker(pid, flags.get("--mesh", "?"), worker_id, cpus)


def pinned_workers(proc: Path = Path("/proc")) -> list[PinnedWorker]:
    """Every pinned kvmesh worker running on this machine (none where /proc is not Linux's)."""
    found = []
    for entry in proc.glob("[0-9]*"):
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        worker = parse_worker(int(entry.name), raw.decode(errors="replace").split("\0"))
        if worker is not None:
            found.append(worker)
    return sorted(found, key=lambda w: w.pid)


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
