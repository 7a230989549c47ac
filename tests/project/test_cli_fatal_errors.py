"""What an operator can fix gets one line that says what to do, an exit code of 1 and no
traceback: a router port already taken (``kvmesh serve router``, ``kvmesh up``), a NATS server
that does not answer (every ``kvmesh serve`` role, ``kvmesh admin``). Real CLI processes."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.service_errors import (
    ServiceStartError,
    check_can_listen,
    find_error,
    listen_error,
)

REPO = Path(__file__).resolve().parents[2]
ROLES = ("router", "kv-registry", "prefill", "decode", "colocated")


def kvmesh(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def the_one_line(stderr: str, prefix: str) -> str:
    """The error line: the last of stderr, starting with ``prefix``, with no traceback before."""
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), stderr[-3000:]
    return last


def closed_nats_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"  # bound once and let go: nothing listens there


# --- the core -----------------------------------------------------------------------------------


def test_listen_errors_name_the_flag_to_change():
    busy = listen_error("0.0.0.0", 8000, OSError(errno.EADDRINUSE, "in use"))
    assert "port 8000 on 0.0.0.0 is already in use" in str(busy) and "--port" in str(busy)
    foreign = listen_error("10.1.2.3", 8000, OSError(errno.EADDRNOTAVAIL, "cannot assign"))
    assert "not an address of this machine" in str(foreign) and "--host" in str(foreign)
    low = listen_error("0.0.0.0", 80, OSError(errno.EACCES, "denied"))
    assert "below 1024" in str(low)


def test_check_can_listen_refuses_a_taken_port_and_passes_a_free_one():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServiceStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_can_listen("127.0.0.1", port)
    check_can_listen("127.0.0.1", port)  # let go: free again
    check_can_listen("127.0.0.1", 0)


def test_find_error_looks_inside_task_group_errors():
    wanted = ServiceStartError("port taken")
    nested = ExceptionGroup("outer", [ValueError("x"), ExceptionGroup("inner", [wanted])])
    assert find_error(nested, (ServiceStartError,)) is wanted
    assert find_error(ValueError("x"), (ServiceStartError,)) is None


# --- real processes -----------------------------------------------------------------------------


def test_router_on_a_taken_port_says_so_in_one_line(nats_server):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = kvmesh(
            "serve", "router", "--nats-url", nats_server, "--host", "127.0.0.1", "--port", str(port)
        )
    assert out.returncode == 1
    line = the_one_line(out.stderr, "kvmesh serve router: ")
    assert f"port {port} on 127.0.0.1 is already in use" in line and "--port" in line


def test_up_on_a_taken_port_says_so_in_one_line_and_starts_nothing():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        out = kvmesh("up", "--port", str(port), "--nats-url", closed_nats_url())
    assert out.returncode == 1
    line = the_one_line(out.stderr, "kvmesh up: ")
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert out.stderr.strip() == line  # nothing started, nothing stopped


@pytest.mark.timeout(180)
def test_every_service_without_nats_says_so_in_one_line():
    url = closed_nats_url()
    procs = {  # at once: each waits out the connect timeout (10 s) for a server to come
        role: subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", role, "--nats-url", url],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ROLES
    }
    for role, proc in procs.items():
        _, stderr = proc.communicate(timeout=150)
        assert proc.returncode == 1, (role, stderr[-2000:])
        line = the_one_line(stderr, f"kvmesh serve {role}: ")
        assert f"no NATS server answered at {url}" in line and "--nats-url" in line


def test_admin_without_nats_says_so_in_one_line():
    url = closed_nats_url()
    out = kvmesh("admin", "status", "--nats-url", url)
    assert out.returncode == 1
    line = the_one_line(out.stderr, "kvmesh admin status: ")
    assert f"no NATS server answered at {url}" in line and "--nats-url" in line
