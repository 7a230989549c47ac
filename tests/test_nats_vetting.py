"""Trust no NATS server by accident (issue 27): an unprivileged user who starts an open
``nats-server -js`` on the port first got every prompt of a `kvmesh up` that joined it. Now
`kvmesh up` refuses a server it did not start unless it demands credentials, and says whose
process holds the port; a service given credentials refuses a server that asks for none, at
connect and at a reconnect. Real nats-servers throughout."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh.shared.bus.nats_auth import MeshCredentials
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.bus.nats_service import NatsUnavailableError, connect_nats
from kvmesh.shared.bus.nats_vetting import (
    NatsVettingError,
    parse_info,
    port_holder,
    server_info,
    vet_foreign_server,
)
from kvmesh.shared.bus.subjects import Subjects

from kvmesh.commands.launcher import Launcher, LaunchError
from kvmesh.commands.up_config import UpConfig

REPO = Path(__file__).resolve().parents[1]
MESH = Subjects("kvmesh-tiny")


@pytest.fixture(scope="module")
def creds() -> MeshCredentials:
    return MeshCredentials.generate()


@pytest.fixture(scope="module")
def open_server():
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def locked_server(creds):
    with NatsServer(authorization=creds.server_config(MESH)) as server:
        yield server


def test_info_line_is_parsed_and_anything_else_refused():
    assert parse_info(b'INFO {"auth_required": true, "port": 4222}') == {
        "auth_required": True,
        "port": 4222,
    }
    with pytest.raises(ValueError, match="not a NATS INFO"):
        parse_info(b"HTTP/1.1 400 Bad Request")


def test_the_servers_info_says_whether_it_demands_credentials(open_server, locked_server):
    assert not server_info("127.0.0.1", open_server.port).get("auth_required")
    assert server_info("127.0.0.1", locked_server.port)["auth_required"] is True


def test_the_holder_of_a_port_is_named_with_its_pid_and_user():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        holder = port_holder(sock.getsockname()[1])
    assert holder is not None
    assert (holder.pid, holder.uid) == (os.getpid(), os.getuid())
    assert f"pid {os.getpid()}" in holder.describe() and "(you)" in holder.describe()


def test_up_refuses_an_open_server_it_did_not_start_and_names_its_holder(open_server):
    launcher = Launcher(UpConfig(nats_url=open_server.url, port=0))
    with pytest.raises(LaunchError) as refused:
        launcher.start()
    message = str(refused.value)
    assert "lets anyone connect without credentials" in message
    assert f"held by pid {open_server.pid}" in message and "nats-server" in message
    assert "--nats-insecure" in message
    assert launcher.children == {}  # nothing was started, nothing was sent


def test_up_uses_an_open_server_only_when_told_to(open_server):
    vet_foreign_server("127.0.0.1", open_server.port, insecure=True)  # --nats-insecure
    with pytest.raises(NatsVettingError):
        vet_foreign_server("127.0.0.1", open_server.port, insecure=False)


def test_up_accepts_a_server_that_demands_credentials(locked_server):
    info = vet_foreign_server("127.0.0.1", locked_server.port, insecure=False)
    assert info["auth_required"] is True


def test_up_on_the_command_line_refuses_in_one_line(open_server, tmp_path):
    env = {**os.environ, "KVMESH_STATE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "up", "--port", "0", "--nats-url", open_server.url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("kvmesh up: the NATS")]
    assert len(lines) == 1 and "--nats-insecure" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


async def test_a_service_given_credentials_refuses_an_open_server(open_server, creds):
    with pytest.raises(NatsUnavailableError) as refused:
        async with connect_nats(open_server.url, "decode-0", auth=creds.auth("decode")):
            pass
    assert "asks for no credentials" in str(refused.value)
    assert f"held by pid {open_server.pid}" in str(refused.value)


async def test_a_service_without_credentials_may_use_an_open_server(open_server):
    async with connect_nats(open_server.url, "decode-0") as nc:
        assert nc.is_connected


async def test_a_service_drops_an_open_server_that_took_its_servers_port(creds):
    """The mesh's server dies and another user's open one takes its port: the service,
    reconnecting, finds it open and closes the connection rather than send it anything."""
    server = NatsServer(authorization=creds.server_config(MESH))
    await asyncio.to_thread(server.start)
    port = server.port
    impostor = None
    try:
        async with connect_nats(
            server.url, "decode-0", auth=creds.auth("decode"), reconnect_time_wait_s=0.1
        ) as nc:
            await asyncio.to_thread(server.stop)
            impostor = NatsServer(port)
            await asyncio.to_thread(impostor.start)
            for _ in range(200):
                if nc.is_closed:
                    break
                await asyncio.sleep(0.05)
            assert nc.is_closed
    finally:
        server.stop()
        if impostor is not None:
            impostor.stop()
