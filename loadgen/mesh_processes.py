"""The processes behind a local server, by role, for ``kvmesh bench serve``'s CPU breakdown
(issue 45: with ``--base-url`` it counted the router's CPU alone).

The process listening on the URL's port is the server. Where it is a kvmesh router (``kvmesh
serve router``, as ``kvmesh up`` starts it), its mesh is every ``kvmesh serve`` process with the
same ``--mesh`` and ``--nats-url`` (kvmesh/commands/serve_processes.py), by role: routers,
prefill and decode workers, the kv-registry, the prefill-queue keeper, drafts and kv-stores; and
the nats-server listening on the ``--nats-url`` port, when it runs here. Anything else is one
``server`` process.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from kvmesh.loadgen.proc_sched import pid_listening_on

from kvmesh.commands.serve_processes import PROC, command_line, serve_command, serve_processes

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def server_roles(url: str, proc: Path = PROC) -> dict[str, list[int]]:
    """The processes serving ``url`` on this machine, by role ({} when it is elsewhere or its
    listener is not this user's to see)."""
    pid = _local_listener(url, proc)
    if pid is None:
        return {}
    router = serve_command(pid, command_line(pid, proc))
    if router is None or router.role != "router":
        return {"server": [pid]}
    nats_url = router.flags.get("--nats-url")
    roles: dict[str, list[int]] = {}
    for command in serve_processes(proc):
        if command.mesh == router.mesh and command.flags.get("--nats-url") == nats_url:
            roles.setdefault(command.role, []).append(command.pid)
    nats = _local_listener(nats_url.split(",")[0], proc) if nats_url else None
    if nats is not None:
        roles["nats"] = [nats]
    return roles


def _local_listener(url: str, proc: Path) -> int | None:
    split = urllib.parse.urlsplit(url)
    if split.hostname not in LOCAL_HOSTS:
        return None
    default = {"http": 80, "https": 443, "nats": 4222, "tls": 4222}.get(split.scheme, 80)
    return pid_listening_on(split.port or default, proc)
