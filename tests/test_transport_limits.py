"""Receivers cannot be exhausted by a local peer (issue #15): a connection limit, a handshake
timeout for silent or half-finished hellos, and an accept loop that outlives EMFILE."""

from __future__ import annotations

import asyncio
import errno
import socket
import time

import pytest
import torch
from kvmesh.shared.transport import Access, TransportConfig, WriteEntry, create_transport
from kvmesh.shared.transport.server import SocketServer


def _address(transport) -> tuple[int, object]:
    """(socket family, address) a raw client dials to reach the transport's receiver."""
    info = transport.descriptor().backends[transport.name]
    if transport.name == "tcp":
        return socket.AF_INET, (info["host"], info["port"])
    return socket.AF_UNIX, info["socket"]


async def _wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _write_works(rx, tx) -> None:
    mem = rx.allocate(4096)
    region = rx.register(mem, Access.REMOTE_WRITE)
    src = tx.register(torch.full((4096,), 7, dtype=torch.uint8))
    async with await tx.connect(rx.descriptor()) as ep:
        await asyncio.wait_for(
            ep.write([WriteEntry(src, 0, region.addr, region.rkey, 4096)], 1), 10
        )
    assert int(mem.sum()) == 7 * 4096


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_partial_hello_is_dropped_after_the_handshake_timeout(backend):
    config = TransportConfig(handshake_timeout_s=0.3)
    async with (
        create_transport(backend, config) as rx,
        create_transport(backend, TransportConfig()) as tx,
    ):
        family, address = _address(rx)
        sock = socket.socket(family)
        sock.connect(address)
        sock.sendall(b"\x00\x01\x02")  # 3 bytes of a hello, then silence
        await _wait_until(lambda: rx._server.num_connections == 1)
        sock.settimeout(3.0)
        assert await asyncio.to_thread(sock.recv, 1) == b""  # the receiver hung up
        sock.close()
        await _wait_until(lambda: rx._server.num_connections == 0)
        await _write_works(rx, tx)  # real peers are unaffected


async def test_a_thousand_idle_connections_hold_at_most_the_limit_and_then_go():
    config = TransportConfig(max_connections=64, handshake_timeout_s=0.5)
    async with (
        create_transport("tcp", config) as rx,
        create_transport("tcp", TransportConfig()) as tx,
    ):
        family, address = _address(rx)
        socks = []
        for _ in range(1000):
            s = socket.socket(family)
            s.connect(address)
            socks.append(s)
        server = rx._server
        await _wait_until(lambda: server.num_refused + server.num_accepted >= 1000, 20)
        assert server.peak_connections <= 64 and server.num_refused > 0
        await _wait_until(lambda: server.num_connections == 0)  # none said hello: all dropped
        for s in socks:
            s.close()
        await _write_works(rx, tx)


class _FlakyListener:
    """accept() fails with EMFILE twice, then hands out one real connection, then is closed."""

    def __init__(self, conn: socket.socket) -> None:
        self._results: list[object] = [
            OSError(errno.EMFILE, "Too many open files"),
            OSError(errno.EMFILE, "Too many open files"),
            (conn, None),
            OSError(errno.EBADF, "closed"),
        ]

    def accept(self):
        result = self._results.pop(0)
        if isinstance(result, OSError):
            raise result
        return result

    def shutdown(self, how: int) -> None:
        pass

    def close(self) -> None:
        pass


async def test_accept_loop_outlives_running_out_of_file_descriptors():
    a, b = socket.socketpair()
    served = []
    server = SocketServer(_FlakyListener(a), lambda conn: served.append(conn), "flaky")  # type: ignore[arg-type]
    server.start()
    await _wait_until(lambda: served == [a])
    assert server.num_accept_errors == 2
    await server.aclose()
    b.close()


@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_refused_writes_are_counted_and_logged_with_the_peer(backend, capsys, caplog):
    from kvmesh.shared.transport import RemoteAccessError

    async with (
        create_transport(backend, TransportConfig()) as rx,
        create_transport(backend, TransportConfig(peer_id="probe")) as tx,
    ):
        mem = rx.allocate(4096)
        region = rx.register(mem, Access.REMOTE_WRITE)
        src = tx.register(torch.ones(8192, dtype=torch.uint8))
        async with await tx.connect(rx.descriptor()) as ep:
            with pytest.raises(RemoteAccessError):  # 8 KiB into a 4 KiB region
                await ep.write([WriteEntry(src, 0, region.addr, region.rkey, 8192)], 1)
        await _wait_until(lambda: rx.stats().refused == 1)
        assert int(mem.sum()) == 0  # (the memory goes away with the transport)
    # structlog prints, or goes through stdlib logging once a service configured it
    out = capsys.readouterr().out + caplog.text
    assert "remote access refused" in out and "probe" in out


def test_admin_status_shows_each_decode_workers_refused_accesses():
    from kvmesh.services.kv_registry.core import RegistryState
    from kvmesh.shared.protocol import DecodeAdvert

    core = RegistryState(worker_timeout_s=3.0)
    advert = DecodeAdvert(
        "d0", "disagg", None, 0, 1024, 16, "spec", 8, 8, ((0, 8),), 0, 0, "ready", 0.0,
        refused_accesses=3, stray_immediates=2,
    )  # fmt: skip
    core.observe_advert(advert, now=1.0)
    [row] = core.status(now=1.0)["decode"]
    assert (row["refused_accesses"], row["stray_immediates"]) == (3, 2)


async def test_tcp_half_finished_writes_are_capped_per_connection():
    """A peer that starts writes and never finishes them holds at most MAX_PENDING_WRITES of
    them (a few hundred KB), then is disconnected; real peers are unaffected."""
    from kvmesh.shared.transport.tcp import (
        FLAG_NO_ACK,
        FRAME,
        HELLO,
        MAGIC_FRAME,
        MAGIC_HELLO,
        MAX_PENDING_WRITES,
        OP_WRITE,
        VERSION,
    )

    assert MAX_PENDING_WRITES <= 4096  # a few hundred KB per connection, not 17 MB
    async with (
        create_transport("tcp", TransportConfig()) as rx,
        create_transport("tcp", TransportConfig()) as tx,
    ):
        mem = rx.allocate(4096)
        region = rx.register(mem, Access.REMOTE_WRITE)
        family, address = _address(rx)
        sock = socket.socket(family)
        sock.connect(address)
        peer = b"half-writer"
        sock.sendall(HELLO.pack(MAGIC_HELLO, VERSION, 0, 1, 7, len(peer)) + peer)
        frames = bytearray()
        for seq in range(1, MAX_PENDING_WRITES + 2):  # frame 0 of 2 of each write, never frame 1
            frames += FRAME.pack(
                MAGIC_FRAME, VERSION, OP_WRITE, FLAG_NO_ACK, region.rkey, 0, region.addr, 1,
                seq, 0, 2, region.addr, 1,
            ) + b"x"  # fmt: skip
        await asyncio.to_thread(sock.sendall, bytes(frames))
        sock.settimeout(5.0)
        assert await asyncio.to_thread(sock.recv, 1) == b""  # one write too many: hung up
        sock.close()
        await _wait_until(lambda: not rx._peers)  # its half-finished writes are gone
        assert rx.completion_queue.qsize() == 0
        await _write_works(rx, tx)


async def test_tcp_writer_with_many_small_writes_in_flight_stays_under_the_cap():
    """An honest writer never trips the receiver's cap: it waits for room instead."""
    from kvmesh.shared.transport.tcp import MAX_PENDING_WRITES

    async with (
        create_transport("tcp", TransportConfig()) as rx,
        create_transport("tcp", TransportConfig()) as tx,
    ):
        mem = rx.allocate(4096)
        region = rx.register(mem, Access.REMOTE_WRITE)
        src = tx.register(torch.full((4096,), 3, dtype=torch.uint8))
        n = 3 * MAX_PENDING_WRITES
        async with await tx.connect(rx.descriptor()) as ep:
            writes = [
                ep.write([WriteEntry(src, i % 4096, region.addr + i % 4096, region.rkey, 1)], i)
                for i in range(n)
            ]
            await asyncio.wait_for(asyncio.gather(*writes), 60)
        await _wait_until(lambda: rx.completion_queue.qsize() == n, timeout_s=20)
