"""Where the meshes that ``kvmesh up`` runs on this machine can be found.

Each running ``kvmesh up`` keeps a small file, ``<mesh>.<pid>.json`` (mode 0600, in a 0700
folder), saying its mesh's NATS URL, where the admin password of the nats-server it started lies,
the router's URL and every service's metrics URL. ``kvmesh admin`` reads it when no ``--nats-url`` is given, so
``kvmesh admin status --mesh NAME`` finds a mesh whose nats-server runs on a port of its own; a
second ``kvmesh up`` reads it to tell another mesh's nats-server from an operator's.

The folder: ``$KVMESH_STATE_DIR``, else ``$XDG_RUNTIME_DIR/kvmesh``, else ``~/.cache/kvmesh/run``.
A file whose process is gone is stale: it is ignored and removed.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec
from kvmesh.shared.config.private_path import private_dir

STATE_DIR_ENV = "KVMESH_STATE_DIR"


@dataclass(frozen=True, slots=True)
class MeshState:
    mesh: str
    nats_url: str  # without credentials (strip_credentials): those stay in the environment
    pid: int  # the kvmesh up process
    router_url: str = ""
    admin_password_file: str = ""  # "" when kvmesh up did not start the nats-server
    metrics_urls: dict[str, str] = field(default_factory=dict)  # service name -> its /metrics

    @property
    def path_name(self) -> str:
        return f"{self.mesh}.{self.pid}.json"


def state_dir() -> Path:
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "kvmesh"
    return Path.home() / ".cache" / "kvmesh" / "run"


def write_state(state: MeshState) -> Path:
    """Record ``state`` (replacing this process's earlier record of it); returns the file."""
    folder = state_dir()
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    private_dir(folder)  # ours, 0700, on a path no one else can change (UntrustedPathError)
    path = folder / state.path_name
    # a fresh name, created exclusively (a planted link there fails), then renamed over the
    # record: the rename replaces a link at ``path`` itself, never what it points to
    fd, tmp = tempfile.mkstemp(prefix=f".{state.path_name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_state(state: MeshState) -> None:
    (state_dir() / state.path_name).unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def running_meshes() -> list[MeshState]:
    """Every mesh a live ``kvmesh up`` on this machine recorded, by mesh name then pid."""
    folder = state_dir()
    if not folder.is_dir():
        return []
    found: list[MeshState] = []
    for path in folder.glob("*.json"):
        try:
            state = msgspec.json.decode(path.read_bytes(), type=MeshState)
        except (OSError, ValueError, TypeError):
            continue  # being written, or not ours
        if not _alive(state.pid):
            path.unlink(missing_ok=True)
            continue
        found.append(state)
    return sorted(found, key=lambda s: (s.mesh, s.pid))
