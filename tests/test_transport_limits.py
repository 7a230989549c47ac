"""Receivers cannot be exhausted by a local peer (issue #15): a connection limit, a handshake
timeout for silent or half-finished hellos, and an accept loop that outlives EMFILE."""

from __future__ import annotations

import asyncio
import errno
import socket
import time

import pytest
import torch

from shared.transport import Access, TransportConfig, WriteEntry, create_transport
from shared.transport.server import SocketServer


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
    from shared.transport import RemoteAccessError

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
    from services.kv_registry.core import Registry
    from shared.protocol import DecodeAdvert

    core = Registry(worker_timeout_s=3.0)
    advert = DecodeAdvert(
        "d0", "disagg", {}, 0, 1024, 16, "spec", 8, 8, ((0, 8),), 0, 0, "ready", 0.0,
        refused_accesses=3, stray_immediates=2,
    )  # fmt: skip
    core.observe_advert(advert, now=1.0)
    [row] = core.status(now=1.0)["decode"]
    assert (row["refused_accesses"], row["stray_immediates"]) == (3, 2)
