"""Same-host tcp lanes over a unix socket with the peer's uid checked (issue 40,
``transport/unix_lanes.py``): a lane over it carries writes, another user's connection is
reset before a byte, and a descriptor from elsewhere (another host, a path not ours) is
dialed over TCP."""

from __future__ import annotations

import asyncio
import os
import pwd
import socket
import stat

import msgspec
import pytest
import torch
from kvmesh.shared.transport import Access, TransportConfig, WriteEntry
from kvmesh.shared.transport.lane_auth import CHALLENGE
from kvmesh.shared.transport.tcp import TcpTransport
from kvmesh.shared.transport.unix_lanes import local_path
from support.transport_wire import over_the_wire, remote, tcp_part

BLOCK = 4096


async def _write_lands(rx: TcpTransport, tx: TcpTransport, descriptor, imm: int):
    """Connect to ``descriptor`` (rx's), write one block, check it landed; the endpoint's
    unix path (None: TCP)."""
    mem = rx.allocate(BLOCK)
    region = remote(rx, rx.register(mem, Access.REMOTE_WRITE))
    src = tx.register(torch.full((BLOCK,), imm, dtype=torch.uint8))
    async with await tx.connect(descriptor) as ep:
        await asyncio.wait_for(
            ep.write([WriteEntry(src, 0, region.addr, region.rkey, BLOCK)], imm), 30
        )
        path = ep.unix_path
    assert (await rx.completion_queue.get()).imm == imm
    assert bool((mem == imm).all())
    return path


async def test_a_same_host_lane_goes_over_the_private_unix_socket_and_carries_a_write() -> None:
    async with TcpTransport(TransportConfig()) as rx, TcpTransport(TransportConfig()) as tx:
        descriptor = over_the_wire(rx.descriptor())
        path = tcp_part(descriptor).unix
        assert path is not None and path == rx.unix_path
        folder = os.stat(os.path.dirname(path))
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == os.geteuid()
        assert await _write_lands(rx, tx, descriptor, 3) == path
        assert rx._server.num_accepted == 2  # both lanes, past their hello
    assert not os.path.exists(os.path.dirname(path))  # removed at close


async def test_a_descriptor_from_another_host_or_with_a_foreign_path_is_dialed_over_tcp(
    tmp_path,
) -> None:
    async with TcpTransport(TransportConfig()) as rx, TcpTransport(TransportConfig()) as tx:
        descriptor = rx.descriptor()
        elsewhere = msgspec.structs.replace(descriptor, host_id="other-host/boot")
        assert await _write_lands(rx, tx, elsewhere, 4) is None
        info = tcp_part(descriptor)
        for path in (f"{tmp_path}/kvmesh-lanes-1-x/lanes.sock", "lanes.sock", "/tmp/../x"):
            forged = msgspec.structs.replace(info, unix=path)
            assert local_path(descriptor, forged) is None, path
        part = msgspec.structs.replace(info, unix=f"{tmp_path}/kvmesh-lanes-1-x/lanes.sock")
        foreign = msgspec.structs.replace(descriptor, backends=(part,))
        assert await _write_lands(rx, tx, foreign, 5) is None
        assert local_path(descriptor, info) == rx.unix_path


def _connect_as(uid: int, gid: int, path: str) -> str:
    """Connect to the unix socket ``path`` as ``uid`` (a forked child); what it met: "no access"
    (the folder kept it out), "reset" (the receiver hung up with nothing said) or "challenged"."""
    pid = os.fork()
    if pid == 0:  # the child: syscalls only, then _exit
        code = 9
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(20)
            try:
                sock.connect(path)
            except PermissionError:
                code = 2
            else:
                try:
                    code = 1 if sock.recv(CHALLENGE.size) else 0
                except ConnectionResetError:
                    code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return {0: "reset", 1: "challenged", 2: "no access"}.get(code, f"child failed ({code})")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another uid needs root")
async def test_another_users_connection_to_the_lane_socket_is_refused_before_a_byte() -> None:
    nobody = pwd.getpwnam("nobody")
    async with TcpTransport(TransportConfig()) as rx:
        path = rx.unix_path
        assert path is not None
        said = await asyncio.to_thread(_connect_as, nobody.pw_uid, nobody.pw_gid, path)
        assert said == "no access"  # the 0700 folder
        os.chmod(os.path.dirname(path), 0o711)  # opened up: the uid check alone
        os.chmod(path, 0o777)
        said = await asyncio.to_thread(_connect_as, nobody.pw_uid, nobody.pw_gid, path)
        assert said == "reset"
        assert rx._server.num_refused == 1 and rx._server.num_pending == 0
        # this process's own user (root) is challenged as before
        assert await asyncio.to_thread(_connect_as, os.geteuid(), os.getegid(), path) == (
            "challenged"
        )
