"""Trust no NATS server by accident (issue 27): an unprivileged user who starts an open
``nats-server -js`` on the port first got every prompt of a `kvmesh up` that joined it. Now
`kvmesh up` refuses a server it did not start unless it demands credentials, and says whose
process holds the port; a service given credentials refuses a server that asks for none, at
connect and at a reconnect. Real nats-servers throughout."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh.shared.bus.nats_auth import ADMIN, USER_ENV, MeshCredentials
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, connect_nats
from kvmesh.shared.bus.nats_server import NatsServer
from kvmesh.shared.bus.nats_vetting import (
    NatsVettingError,
    _endpoint,
    connection_owner,
    parse_info,
    port_holder,
    server_info,
    vet_connection,
    vet_foreign_server,
)
from kvmesh.shared.config.subjects import Subjects

from kvmesh.commands.launch_error import LaunchError
from kvmesh.commands.launcher import Launcher
from kvmesh.commands.up_config import UpConfig

REPO = Path(__file__).resolve().parents[2]
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


async def test_a_service_never_joins_an_open_server_that_took_its_servers_port(creds):
    """The mesh's server dies and another open one takes its port: the service, reconnecting,
    finds it open and sends it no CONNECT; it keeps trying (the mesh's own may come back)."""
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
            for _ in range(40):  # several reconnect attempts reach the impostor
                await asyncio.sleep(0.05)
            assert not nc.is_connected and nc.stats["reconnects"] == 0
            assert "asks for no credentials" in str(nc.last_error)
    finally:
        server.stop()
        if impostor is not None:
            impostor.stop()


# --- issue 40, high #1: who holds the socket decides, not what INFO says ------------------------

NOBODY = 65534
as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a process as another user needs root"
)

# Another local user's trick: an open nats-server behind a proxy that adds "auth_required" to
# its INFO line. It prints every byte a client sends it (a CONNECT would carry the password).
PROXY = r"""
import asyncio, json, sys
LISTEN, UPSTREAM = int(sys.argv[1]), int(sys.argv[2])
async def pipe(reader, writer, tap):
    try:
        while data := await reader.read(65536):
            if tap:
                print(repr(data), flush=True)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
async def client(c_reader, c_writer):
    u_reader, u_writer = await asyncio.open_connection("127.0.0.1", UPSTREAM)
    line = await u_reader.readline()
    info = json.loads(line[5:])
    info["auth_required"] = True
    c_writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
    await c_writer.drain()
    await asyncio.gather(pipe(c_reader, u_writer, True), pipe(u_reader, c_writer, False))
async def main():
    server = await asyncio.start_server(client, "127.0.0.1", LISTEN)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


def _as_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@contextlib.contextmanager
def squatting_proxy(port: int, upstream_port: int):
    """The proxy, run as user nobody on ``port``; yields a function returning what it heard."""
    proc = subprocess.Popen(
        ["/usr/bin/python3", "-c", PROXY, str(port), str(upstream_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=_as_nobody,
        cwd="/",
    )
    try:
        assert proc.stdout.readline().strip() == b"listening"
        heard: list[bytes] = []

        def what_it_heard() -> bytes:
            proc.kill()
            heard.append(proc.stdout.read())
            return b"".join(heard)

        yield what_it_heard
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_owner_of_our_connections_far_end_is_the_servers_user(open_server):
    with socket.create_connection(("127.0.0.1", open_server.port)) as sock:
        assert connection_owner(sock.getsockname(), sock.getpeername()) == os.geteuid()


def test_a_proc_net_tcp_address_reads_as_an_address_and_a_port():
    assert _endpoint("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    mapped = "0000000000000000FFFF00000100007F:0016"  # ::ffff:127.0.0.1, as tcp6 prints it
    assert _endpoint(mapped) == (ipaddress.ip_address("127.0.0.1"), 22)


def test_a_server_on_no_socket_of_this_machine_gets_credentials_only_by_tls_or_trust(tmp_path):
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "tcp").write_text("header\n")  # no socket here is the far end
    far = (("10.0.0.2", 50000), ("10.0.0.1", 4222))
    why = vet_connection(*far, tls_verified=False, trust_network=False, proc=tmp_path)
    assert why is not None and "not on this machine" in why and "--nats-trust-network" in why
    assert vet_connection(*far, tls_verified=True, trust_network=False, proc=tmp_path) is None
    assert vet_connection(*far, tls_verified=False, trust_network=True, proc=tmp_path) is None


def test_up_joins_a_server_it_did_not_start_only_with_credentials_for_it(locked_server):
    with pytest.raises(NatsVettingError, match="no credentials for it"):
        vet_foreign_server("127.0.0.1", locked_server.port, insecure=False)
    info = vet_foreign_server("127.0.0.1", locked_server.port, insecure=False, has_credentials=True)
    assert info["auth_required"] is True


@as_root
async def test_a_service_sends_no_credentials_to_another_users_proxy_that_claims_auth(
    open_server, creds
):
    port = _free_port()
    with squatting_proxy(port, open_server.port) as heard:
        with pytest.raises(NatsUnavailableError) as refused:
            async with connect_nats(f"nats://127.0.0.1:{port}", "decode-0", auth=creds.auth(ADMIN)):
                pass
        sent = heard()
    assert "user nobody" in str(refused.value) and "not by this user" in str(refused.value)
    assert b"CONNECT" not in sent and creds.auth(ADMIN).password.encode() not in sent


@as_root
def test_up_refuses_another_users_proxy_that_claims_auth_before_sending_anything(
    open_server, monkeypatch, tmp_path
):
    port = _free_port()
    monkeypatch.setenv("KVMESH_STATE_DIR", str(tmp_path))
    monkeypatch.setenv(USER_ENV, ADMIN)
    monkeypatch.setenv("KVMESH_NATS_PASSWORD", "the-admin-password")
    with squatting_proxy(port, open_server.port) as heard:
        launcher = Launcher(UpConfig(nats_url=f"nats://127.0.0.1:{port}", port=0))
        with pytest.raises(LaunchError, match="user nobody"):
            launcher.start()
        sent = heard()
    assert launcher.children == {}
    assert b"the-admin-password" not in sent and b"CONNECT" not in sent


@as_root
async def test_a_reconnect_sends_no_credentials_to_a_squatter_on_the_servers_port(creds):
    """The mesh's server dies and another user's proxy (claiming auth) takes its port: the
    service keeps trying and sends the proxy nothing; the mesh's server back, it reconnects."""
    server = NatsServer(authorization=creds.server_config(MESH))
    await asyncio.to_thread(server.start)
    port = server.port
    open_one = NatsServer()
    await asyncio.to_thread(open_one.start)
    try:
        async with connect_nats(
            server.url, "decode-0", auth=creds.auth("decode"), reconnect_time_wait_s=0.1
        ) as nc:
            await asyncio.to_thread(server.stop)
            with squatting_proxy(port, open_one.port) as heard:
                for _ in range(100):  # a few reconnect attempts reach the proxy
                    await asyncio.sleep(0.05)
                assert not nc.is_connected
                sent = heard()
            assert b"CONNECT" not in sent and creds.auth("decode").password.encode() not in sent
            assert nc.stats["reconnects"] == 0 and not nc.is_closed  # still trying, nothing sent
    finally:
        server.stop()
        open_one.stop()
