"""tcp backend wire behaviour: hand-crafted frames from a raw socket, lanes, windows."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time

import pytest
import torch
from kvmesh.shared.kv.descriptor import TcpBackend
from kvmesh.shared.transport import (
    Access,
    PeerGoneError,
    RefusalReason,
    TransportConfig,
    TransportDescriptor,
    WriteEntry,
)
from kvmesh.shared.transport.tcp import (
    ACK,
    FLAG_NO_ACK,
    FRAME,
    MAGIC_ACK,
    MAGIC_FRAME,
    OP_WRITE,
    VERSION,
    TcpTransport,
)
from support.transport_wire import FAKE_SECRET, accept_hello, raw_lane, remote

NBYTES = 64 << 10
GUARD = 0xAB


def timeout(coro, seconds: float = 20.0):
    return asyncio.wait_for(coro, seconds)


class Receiver:
    """A tcp transport with one remotely writable region between two guard spans."""

    def __init__(self, rx: TcpTransport) -> None:
        self.rx = rx
        self.mem = rx.allocate(NBYTES + 2 * 4096)
        self.mem.fill_(GUARD)
        self.body = self.mem[4096 : 4096 + NBYTES]
        self.body.zero_()
        self.region = remote(rx, rx.register(self.body, Access.REMOTE_WRITE))

    def guards_intact(self) -> bool:
        return bool((self.mem[:4096] == GUARD).all() and (self.mem[-4096:] == GUARD).all())


def frame(
    rkey: int,
    addr: int,
    length: int,
    seq: int = 1,
    imm: int = 0,
    span=None,
    idx=0,
    count=1,
    flags=0,
) -> bytes:
    span_addr, span_len = span or (addr, length)
    return FRAME.pack(
        MAGIC_FRAME, VERSION, OP_WRITE, flags, rkey, imm, addr, length, seq, idx, count, span_addr,
        span_len,
    )  # fmt: skip


def read_ack(sock: socket.socket) -> tuple[int, int, int]:
    data = b""
    while len(data) < ACK.size:
        chunk = sock.recv(ACK.size - len(data))
        assert chunk, "receiver closed the connection instead of answering"
        data += chunk
    magic, status, _op, _, _idx, seq, length = ACK.unpack(data)
    assert magic == MAGIC_ACK
    return status, seq, length


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@contextlib.asynccontextmanager
async def connected_writer(
    receiver: Receiver, buffer: torch.Tensor, config: TransportConfig | None = None
):
    """A tcp transport (``config``, default settings without) with ``buffer`` registered and
    connected to ``receiver``: yields ``buffer``'s region and the endpoint."""
    async with TcpTransport(config or TransportConfig()) as tx:
        local = tx.register(buffer)
        async with await tx.connect(receiver.rx.descriptor()) as ep:
            yield local, ep


@pytest.fixture
async def receiver():
    async with TcpTransport(TransportConfig()) as rx:
        yield Receiver(rx)


async def test_refused_frame_is_nacked_drained_and_the_connection_keeps_working(receiver) -> None:
    r = receiver.region
    sock = await asyncio.to_thread(raw_lane, receiver.rx.descriptor())
    payload = b"\x11" * 1000
    sock.sendall(frame(r.rkey ^ 0xFF, r.addr, 1000, seq=1, imm=5) + payload)
    status, seq, _ = await asyncio.to_thread(read_ack, sock)
    assert (status, seq) == (RefusalReason.REFUSED, 1)  # alike, whatever the reason
    sock.sendall(frame(r.rkey, r.end - 500, 1000, seq=2, imm=6) + payload)  # crosses the end
    assert (await asyncio.to_thread(read_ack, sock))[0] == RefusalReason.REFUSED
    sock.sendall(frame(r.rkey, r.addr + 100, 1000, seq=3, imm=7) + payload)
    assert (await asyncio.to_thread(read_ack, sock))[:2] == (0, 3)
    c = await timeout(receiver.rx.completion_queue.get())
    assert (c.imm, c.peer_id, c.num_bytes) == (7, "raw-peer", 1000)
    assert bytes(receiver.body[100:1100].numpy()) == payload
    assert int(receiver.body.sum()) == 0x11 * 1000  # nothing else written
    assert receiver.guards_intact()
    stats = receiver.rx.stats()
    assert (stats.writes, stats.refused) == (1, 2)
    sock.close()


@pytest.mark.parametrize(
    "bad",
    [
        "oversized_length",
        "bad_magic",
        "bad_version",
        "frame_outside_its_span",
        "truncated_payload",
        "truncated_header",
    ],
)
async def test_corrupt_frames_close_the_connection_and_write_nothing(receiver, bad: str) -> None:
    r = receiver.region
    sock = await asyncio.to_thread(raw_lane, receiver.rx.descriptor())
    good = frame(r.rkey, r.addr, 4096, imm=1)
    data = {
        "oversized_length": frame(r.rkey, r.addr, 1 << 40),
        "bad_magic": b"XXXX" + good[4:],
        "bad_version": good[:4] + bytes([99]) + good[5:],
        "frame_outside_its_span": frame(r.rkey, r.addr + 8192, 4096, span=(r.addr, 4096)),
        "truncated_payload": good + b"\x22" * 1000,
        "truncated_header": good[:20],
    }[bad]
    sock.sendall(data)
    if bad.startswith("truncated"):
        sock.shutdown(socket.SHUT_WR)  # the writer dies mid-frame
    assert await asyncio.to_thread(closed_by_peer, sock)
    sock.close()
    await asyncio.sleep(0.05)
    assert receiver.rx.completion_queue.get_nowait() is None
    assert receiver.guards_intact()
    if bad != "truncated_payload":  # a truncated payload may have landed partly, inside the target
        assert int(receiver.body.sum()) == 0
    # the receiver still serves other peers
    src = torch.full((4096,), 3, dtype=torch.uint8)
    async with connected_writer(receiver, src) as (local, ep):
        await timeout(ep.write([WriteEntry(local, 0, r.addr + 8192, r.rkey, 4096)], 9))
    assert (await timeout(receiver.rx.completion_queue.get())).imm == 9


async def test_large_write_is_sliced_across_lanes_and_completes_once(receiver) -> None:
    r = receiver.region
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
    cfg = TransportConfig(tcp_lanes=4, tcp_slice_bytes=4096, tcp_window=2)
    async with connected_writer(receiver, src, cfg) as (local, ep):
        assert ep.num_lanes == 2  # the receiver advertises 2 lanes (its default)
        # one entry per 8 KiB, given in reverse: remote runs are not merged across entries
        entries = [
            WriteEntry(local, off, r.addr + off, r.rkey, 8192)
            for off in reversed(range(0, NBYTES, 8192))
        ]
        await timeout(ep.write(entries, 42))
        assert 1 <= ep.max_in_flight <= 2  # 16 frames, window 2 per lane
        assert all(lane.window.peak_items > 0 for lane in ep._lanes)  # both lanes carried frames
    c = await timeout(receiver.rx.completion_queue.get())
    assert (c.imm, c.num_bytes) == (42, NBYTES)
    assert receiver.rx.completion_queue.get_nowait() is None
    assert torch.equal(receiver.body, src)
    assert receiver.guards_intact()


async def test_window_bounds_frames_in_flight_under_a_stream_of_writes(receiver) -> None:
    r = receiver.region
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
    cfg = TransportConfig(tcp_lanes=1, tcp_slice_bytes=4096, tcp_window=3)
    async with connected_writer(receiver, src, cfg) as (local, ep):
        writes = [
            ep.write([WriteEntry(local, 0, r.addr, r.rkey, NBYTES)], i)  # 16 frames each
            for i in range(8)
        ]
        await timeout(asyncio.gather(*writes))
        assert ep.max_in_flight == 3  # 128 frames queued, never more than the window out
    imms = [(await timeout(receiver.rx.completion_queue.get())).imm for _ in range(8)]
    assert imms == list(range(8))
    assert torch.equal(receiver.body, src)


async def test_read_pulls_remote_bytes_and_is_refused_without_read_access(receiver) -> None:
    r = receiver.region
    receiver.body.copy_(torch.arange(NBYTES, dtype=torch.int64).to(torch.uint8))
    rx = receiver.rx
    readable = remote(rx, rx.register(receiver.body[:8192], Access.REMOTE_READ))
    dst = torch.zeros(8192, dtype=torch.uint8)
    cfg = TransportConfig(tcp_slice_bytes=4096)
    async with connected_writer(receiver, dst, cfg) as (local, ep):
        await timeout(ep.read([WriteEntry(local, 0, readable.addr, readable.rkey, 8192)]))
        assert torch.equal(dst, receiver.body[:8192])
        with pytest.raises(Exception, match="refused"):
            await timeout(ep.read([WriteEntry(local, 0, r.addr, r.rkey, 4096)]))
    stats = receiver.rx.stats()
    assert (stats.reads, stats.read_bytes, stats.refused) == (1, 8192, 1)


def test_frame_header_layout_is_64_bytes() -> None:
    assert FRAME.size == 64
    assert struct.calcsize("<4sBBHIQQ") == ACK.size


async def test_write_to_a_peer_that_never_acks_times_out_with_peer_gone() -> None:
    mute = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    port = mute.getsockname()[1]
    desc = TransportDescriptor("mute", "elsewhere", (TcpBackend("127.0.0.1", port, FAKE_SECRET),))
    try:
        async with TcpTransport(TransportConfig(op_timeout_s=0.5)) as tx:
            local = tx.register(torch.zeros(4096, dtype=torch.uint8))

            def answer_and_go_mute() -> None:
                conn = mute.accept()[0]
                accepted.append(conn)
                accept_hello(conn, bytes.fromhex(FAKE_SECRET))

            answering = asyncio.ensure_future(asyncio.to_thread(answer_and_go_mute))
            ep = await tx.connect(desc)
            await answering
            with pytest.raises(PeerGoneError, match=r"did not acknowledge within 0\.5 s"):
                await timeout(ep.write([WriteEntry(local, 0, 0x1000, 1, 4096)], 1))
            with pytest.raises(PeerGoneError):  # the endpoint stays failed
                await timeout(ep.write([WriteEntry(local, 0, 0x1000, 1, 4096)], 2))
    finally:
        for s in accepted:
            s.close()
        mute.close()


async def test_frames_flagged_no_ack_are_acked_only_by_a_later_frame_or_a_refusal(receiver) -> None:
    r = receiver.region
    sock = await asyncio.to_thread(raw_lane, receiver.rx.descriptor())
    payload = b"\x05" * 1024
    for idx in range(3):  # one write of three frames; only the last asks for an ACK
        flags = 0 if idx == 2 else FLAG_NO_ACK
        addr = r.addr + idx * 1024
        sock.sendall(frame(r.rkey, addr, 1024, seq=1, imm=4, idx=idx, count=3, flags=flags))
        sock.sendall(payload)
    bad = frame(r.rkey ^ 0xFF, r.addr, 1024, seq=2, imm=5, flags=FLAG_NO_ACK)
    sock.sendall(bad + payload)  # refused: NAKed even though it asks for no ACK
    sock.settimeout(5)
    data = b""
    while len(data) < 2 * ACK.size:
        chunk = await asyncio.to_thread(sock.recv, 2 * ACK.size - len(data))
        assert chunk
        data += chunk
    acks = [ACK.unpack_from(data, i * ACK.size) for i in range(2)]
    assert [(a[1], a[5], a[4]) for a in acks] == [(0, 1, 2), (RefusalReason.REFUSED, 2, 0)]
    c = await timeout(receiver.rx.completion_queue.get())
    assert (c.imm, c.num_bytes) == (4, 3 * 1024)
    assert bytes(receiver.body[: 3 * 1024].numpy()) == payload * 3
    sock.close()


class SlowAcker:
    """A one-lane tcp peer that reads frames and ACKs only when the test says so."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.frames: list[tuple[int, int, int]] = []  # (seq, idx, flags) as received
        self.conn: socket.socket | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def descriptor(self) -> TransportDescriptor:
        port = self.server.getsockname()[1]
        info = TcpBackend("127.0.0.1", port, FAKE_SECRET)
        return TransportDescriptor("slow", "elsewhere", (info,))

    def _recv(self, n: int) -> bytes:
        assert self.conn is not None
        data = self.conn.recv(n, socket.MSG_WAITALL)
        return data if len(data) == n else b""

    def _serve(self) -> None:
        self.conn, _ = self.server.accept()
        accept_hello(self.conn, bytes.fromhex(FAKE_SECRET))
        while hdr := self._recv(FRAME.size):
            fields = FRAME.unpack(hdr)
            flags, length, seq, idx = fields[3], fields[7], fields[8], fields[9]
            if not self._recv(length):
                return
            self.frames.append((seq, idx, flags))

    def wait_frames(self, n: int) -> list[tuple[int, int, int]]:
        deadline = time.monotonic() + 10
        while len(self.frames) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # anything beyond n would have arrived by now
        return list(self.frames)

    def ack(self, seq: int, idx: int) -> None:
        assert self.conn is not None
        self.conn.sendall(ACK.pack(MAGIC_ACK, 0, OP_WRITE, 0, idx, seq, 0))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.close()
        self.thread.join(5)


async def test_window_is_in_bytes_and_one_cumulative_ack_frees_it() -> None:
    peer = SlowAcker()
    cfg = TransportConfig(tcp_lanes=1, tcp_window=2, tcp_slice_bytes=8192)  # 16 KiB per lane
    try:
        async with TcpTransport(cfg) as tx:
            local = tx.register(torch.zeros(32 << 10, dtype=torch.uint8))
            async with await tx.connect(peer.descriptor()) as ep:
                assert ep.window_bytes == 16 << 10
                # 32 scattered 1 KiB entries: 32 frames, 16 of them fill the window
                entries = [
                    WriteEntry(local, i << 10, 0x10000 + i * 4096, 1, 1024) for i in range(32)
                ]
                write = asyncio.ensure_future(ep.write(entries, 1))
                first = await asyncio.to_thread(peer.wait_frames, 16)
                assert [idx for _, idx, _ in first] == list(range(16))  # not 2 (tcp_window) frames
                # an ACK is asked for every window/4 bytes and by the last frame sent
                asked = [idx for _, idx, flags in first if not flags & FLAG_NO_ACK]
                assert asked == [3, 7, 11, 15]
                peer.ack(1, 15)  # covers frames 0..15
                rest = await asyncio.to_thread(peer.wait_frames, 32)
                assert [idx for _, idx, _ in rest] == list(range(32))
                assert not write.done()
                peer.ack(1, 31)
                await timeout(write)
                assert (ep.max_in_flight, ep.max_in_flight_bytes) == (16, 16 << 10)
    finally:
        peer.close()


async def test_entries_contiguous_on_both_sides_leave_as_one_piece(receiver) -> None:
    r = receiver.region
    src = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8)
    async with connected_writer(receiver, src, TransportConfig(tcp_lanes=1)) as (local, ep):
        merged = [
            WriteEntry(local, off, r.addr + off, r.rkey, 4096) for off in range(0, 32768, 4096)
        ]
        frames = ep._frames(merged, OP_WRITE)
        assert [(f.length, len(f.views)) for f in frames] == [(32768, 1)]
        # remote-contiguous but local pieces in reverse: one frame, one piece per entry
        flipped = [
            WriteEntry(local, 28672 - off, r.addr + off, r.rkey, 4096)
            for off in range(0, 32768, 4096)
        ]
        frames = ep._frames(flipped, OP_WRITE)
        assert [(f.length, len(f.views)) for f in frames] == [(32768, 8)]
        await timeout(ep.write(merged, 1))
        await timeout(ep.write(flipped, 2))
    assert [(await timeout(receiver.rx.completion_queue.get())).imm for _ in range(2)] == [1, 2]
    expected = torch.cat([src[28672 - off : 32768 - off] for off in range(0, 32768, 4096)])
    assert torch.equal(receiver.body[:32768], expected)
