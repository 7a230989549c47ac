"""The ``kvmesh serve`` processes running on this machine, read from their command lines.

``kvmesh up`` starts every service as ``python -m kvmesh.cli serve ROLE --worker-id ID --mesh
MESH ...``: ``/proc/<pid>/cmdline`` tells any user (as ``ps`` does) which mesh a process serves,
in which role, and with which flags. pinned_cores.py reads the cores other meshes pinned from it;
``kvmesh bench serve --base-url`` the processes of the mesh behind a local router
(loadgen/mesh_processes.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ServeCommand:
    pid: int
    role: str  # router, prefill, decode, colocated, kv-registry, prefill-queue, draft, kv-store
    flags: dict[str, str] = field(default_factory=dict)  # every "--flag value" pair

    @property
    def mesh(self) -> str:
        return self.flags.get("--mesh", "?")

    @property
    def worker_id(self) -> str:
        return self.flags.get("--worker-id", self.role)


def serve_command(pid: int, argv: Sequence[str]) -> ServeCommand | None:
    """What ``argv`` runs if it is a ``kvmesh serve`` (else None)."""
    if "serve" not in argv:
        return None
    serve = list(argv).index("serve")
    if serve + 1 >= len(argv):
        return None
    if not any(part.endswith(("kvmesh", "kvmesh.cli")) for part in argv[:serve]):
        return None
    words = [w for w in argv[serve + 2 :] if w]
    flags = {w: v for w, v in zip(words, [*words[1:], ""], strict=True) if w.startswith("--")}
    return ServeCommand(pid, argv[serve + 1], flags)


def command_line(pid: int, proc: Path = PROC) -> list[str]:
    """``pid``'s argv ([] when it is gone or unreadable)."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


def serve_processes(proc: Path = PROC) -> list[ServeCommand]:
    """Every ``kvmesh serve`` process running here, by pid."""
    found = []
    for entry in proc.glob("[0-9]*"):
        command = serve_command(int(entry.name), command_line(int(entry.name), proc))
        if command is not None:
            found.append(command)
    return sorted(found, key=lambda c: c.pid)
