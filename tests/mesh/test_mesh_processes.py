"""``kvmesh bench serve --base-url`` of a local mesh counts the CPU of every process of that mesh
by role (issue 45: the router's alone): the router on the URL's port names its mesh and NATS,
and every ``kvmesh serve`` of the same mesh and NATS joins, by role; another mesh's does not."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

from kvmesh.loadgen.mesh_processes import server_roles
from kvmesh.loadgen.proc_sched import pid_listening_on
from kvmesh.shared.config.ports import free_port
from support.proc_tree import reaped

from kvmesh.commands.serve_processes import serve_command

LISTEN = (
    "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); "
    "s.listen(); time.sleep(120)"
)


@contextlib.contextmanager
def stand_ins(*argvs: list[str]):
    """Processes with these command lines (``python -c ...``), there until the block ends; one
    whose first word is a port listens on it."""
    procs = []
    with contextlib.ExitStack() as stack:
        for argv in argvs:
            code = LISTEN if argv[0].isdigit() else "import time; time.sleep(120)"
            proc = subprocess.Popen([sys.executable, "-c", code, *argv])
            stack.enter_context(reaped(proc))
            procs.append(proc)
        deadline = time.monotonic() + 60
        for argv, proc in zip(argvs, procs, strict=True):
            while not Path(f"/proc/{proc.pid}/cmdline").read_bytes() or (
                argv[0].isdigit() and pid_listening_on(int(argv[0])) != proc.pid
            ):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.02)
        yield procs


def serve(role: str, mesh: str, nats: str, port: int | None = None) -> list[str]:
    head = [str(port)] if port is not None else []
    argv = [*head, "-m", "kvmesh.cli", "serve", role, "--worker-id", f"{role}-0"]
    return [*argv, "--mesh", mesh, "--nats-url", nats, "--threads", "1"]


def test_a_local_routers_mesh_is_found_by_role_with_its_nats() -> None:
    port, nats_port = free_port(), free_port()
    nats = f"nats://127.0.0.1:{nats_port}"
    with stand_ins(
        serve("router", "m", nats, port),
        serve("decode", "m", nats),
        serve("prefill", "m", nats),
        serve("decode", "other", nats),  # another mesh on the same NATS
        serve("decode", "m", "nats://127.0.0.1:1"),  # a mesh of the same name elsewhere
        [str(nats_port), "nats-server"],
    ) as (router, decode, prefill, _, _, nats_server):
        roles = server_roles(f"http://127.0.0.1:{port}/")
    assert roles == {
        "router": [router.pid],
        "decode": [decode.pid],
        "prefill": [prefill.pid],
        "nats": [nats_server.pid],
    }


def test_another_server_is_one_process_and_a_remote_one_none() -> None:
    port = free_port()
    with stand_ins([str(port), "llama-server"]) as (server,):
        assert server_roles(f"http://localhost:{port}") == {"server": [server.pid]}
    assert server_roles("http://10.1.2.3:8000") == {}
    assert serve_command(1, ["python", "-m", "kvmesh.cli", "serve"]) is None
