"""Writer side of the tcp backend: one endpoint = several lanes (sockets) to one receiver.

Per lane a sender thread (``sendmsg`` headers + payload pieces) and an ACK thread (``recv_into``).
``write`` cuts entries into frames and queues them all at once; window credit is taken by the send
thread and returned by the ACK thread, so the data path never waits on the event loop, which only
hears of an operation when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import secrets
import socket
import threading
from collections import deque
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from shared.transport.base import (
    LocalAccessError,
    MemoryRegion,
    PeerDescriptor,
    PeerGoneError,
    PeerUnreachableError,
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
    TransportError,
    WriteEntry,
    check_imm,
)
from shared.transport.tcp import (
    ACK,
    FLAG_NO_ACK,
    FRAME,
    HELLO,
    MAGIC_ACK,
    MAGIC_FRAME,
    MAGIC_HELLO,
    OP_READ,
    OP_WRITE,
    VERSION,
    recv_exact,
    send_all,
    tensor_buffer,
    tune,
)
from shared.transport.threads import ThreadSet, Window

if TYPE_CHECKING:
    from shared.transport.tcp import TcpTransport

MAX_IOV = 512  # payload pieces per frame
MAX_BATCH_IOV = 1024  # iovecs per sendmsg (IOV_MAX on Linux)
# a lane asks for an ACK at least every window/4 bytes, and ends each sendmsg batch with one
ACKS_PER_WINDOW = 4


class _Op:
    """One write() or read() in flight: done when every frame is ACKed or NAKed."""

    __slots__ = ("error", "future", "remaining")

    def __init__(self, future: asyncio.Future[None], num_frames: int) -> None:
        self.future = future
        self.remaining = num_frames
        self.error: TransportError | None = None


class _Frame:
    __slots__ = (
        "addr", "count", "idx", "imm", "kind", "length", "op", "rkey", "seq", "span_addr",
        "span_len", "views",
    )  # fmt: skip

    def __init__(self, kind: int, rkey: int, addr: int) -> None:
        self.kind, self.rkey, self.addr = kind, rkey, addr
        self.length = 0
        self.views: list[memoryview] = []
        self.op: _Op | None = None
        self.seq = self.idx = self.count = self.imm = 0
        self.span_addr = self.span_len = 0

    def header(self, flags: int) -> bytes:
        return FRAME.pack(
            MAGIC_FRAME, VERSION, self.kind, flags, self.rkey, self.imm, self.addr, self.length,
            self.seq, self.idx, self.count, self.span_addr, self.span_len,
        )  # fmt: skip


def _background(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Waits run to their end even if the caller is cancelled (callers await them shielded), so a
    timeout still closes the endpoint and later writes still wait for earlier ones."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _close_run(run: list[_Frame]) -> None:
    if run:
        span = (run[0].addr, run[-1].addr + run[-1].length - run[0].addr)
        for frame in run:
            frame.span_addr, frame.span_len = span


class _Lane:
    """One socket: frames queued by the event loop, sent by its send thread within ``window``
    bytes, and settled (oldest first: ACKs are cumulative) by its ACK thread."""

    __slots__ = ("acked", "index", "lock", "queued", "sends", "sock", "unacked", "window")

    def __init__(self, index: int, sock: socket.socket, window_bytes: int) -> None:
        self.index = index
        self.sock = sock
        self.window = Window(window_bytes)
        self.sends: queue.SimpleQueue[_Frame | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.unacked: deque[_Frame] = deque()  # sent, in send order
        self.queued = 0  # bytes ever queued (event loop) ...
        self.acked = 0  # ... and ever settled (ACK thread): the difference is outstanding

    def settle(self, kind: int, seq: int, idx: int) -> list[_Frame]:
        """Frames covered by the ACK of ``(kind, seq, idx)``: it and every frame sent before it."""
        done: list[_Frame] = []
        with self.lock:
            while self.unacked:
                frame = self.unacked.popleft()
                done.append(frame)
                if frame.idx == idx and frame.seq == seq and frame.kind == kind:
                    return done
        raise ProtocolError(f"ack for a frame never sent (op {kind}, seq {seq}, frame {idx})")


class TcpEndpoint:
    backend = "tcp"

    def __init__(self, transport: TcpTransport, descriptor: PeerDescriptor) -> None:
        self._transport = transport
        self._peer_id = descriptor.peer_id
        info = descriptor.backends["tcp"]
        self._address = (str(info["host"]), int(info["port"]))
        config = transport.config
        self._slice = config.tcp_slice_bytes
        # the bytes `tcp_window` full slices hold: smaller frames do not shrink the window
        self._window_bytes = config.tcp_window * config.tcp_slice_bytes
        self._op_timeout_s = config.op_timeout_s
        self._lanes: list[_Lane] = []
        self._threads = ThreadSet()
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()  # op.remaining / op.error, settled from every ACK thread
        self._ops: set[_Op] = set()
        self._write_seq = self._read_seq = 0
        self._last_write: asyncio.Task[None] | None = None
        self._broken: TransportError | None = None
        self._closed = False

    @classmethod
    async def open(cls, transport: TcpTransport, descriptor: PeerDescriptor) -> TcpEndpoint:
        info = descriptor.backends.get("tcp")
        if info is None:
            raise PeerUnreachableError(f"peer {descriptor.peer_id} offers no tcp backend")
        ep = cls(transport, descriptor)
        num_lanes = max(1, min(transport.config.tcp_lanes, int(info.get("lanes", 1))))
        endpoint_id = secrets.randbits(63)
        hello_id = transport.peer_id.encode()
        try:
            for i in range(num_lanes):
                sock = await asyncio.to_thread(
                    socket.create_connection,
                    ep._address,
                    transport.config.connect_timeout_s,
                )
                sock.settimeout(None)
                tune(sock)
                sock.sendall(
                    HELLO.pack(MAGIC_HELLO, VERSION, i, num_lanes, endpoint_id, len(hello_id))
                    + hello_id
                )
                ep._lanes.append(_Lane(i, sock, ep._window_bytes))
        except OSError as exc:
            for lane in ep._lanes:
                lane.sock.close()
            raise PeerUnreachableError(
                f"cannot reach tcp peer {descriptor.peer_id} at {ep._address}: {exc}"
            ) from exc
        for lane in ep._lanes:
            ep._threads.spawn(ep._send_loop, f"tcp-send-{lane.index}", lane)
            ep._threads.spawn(ep._ack_loop, f"tcp-ack-{lane.index}", lane)
        return ep

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def num_lanes(self) -> int:
        return len(self._lanes)

    @property
    def window_bytes(self) -> int:
        """Bytes one lane may have sent and not yet had ACKed (``tcp_window`` x slice)."""
        return self._window_bytes

    @property
    def max_in_flight(self) -> int:
        """Most frames ever in flight on one lane."""
        return max(lane.window.peak_items for lane in self._lanes)

    @property
    def max_in_flight_bytes(self) -> int:
        """Most bytes ever in flight on one lane (never above ``window_bytes``)."""
        return max(lane.window.peak_bytes for lane in self._lanes)

    async def __aenter__(self) -> TcpEndpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._transport._endpoints.discard(self)
        self._break(TransportClosedError(f"endpoint to {self._peer_id} was closed"))
        await asyncio.to_thread(self._threads.join)
        for lane in self._lanes:
            lane.sock.close()

    # -- operations --------------------------------------------------------------------------------

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        check_imm(imm)
        frames = self._frames(entries, OP_WRITE)
        self._write_seq += 1
        op = self._post(frames, self._write_seq, imm)
        prev = self._last_write
        task = self._last_write = _background(self._wait(op, prev))
        await asyncio.shield(task)

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        frames = self._frames(entries, OP_READ)
        self._read_seq += 1
        op = self._post(frames, self._read_seq, 0)
        await asyncio.shield(_background(self._wait(op, None)))

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise TransportClosedError(f"endpoint to {self._peer_id} is closed")

    def _frames(self, entries: Sequence[WriteEntry], kind: int) -> list[_Frame]:
        """Cut entries into frames of at most ``slice`` bytes. Entries contiguous in the remote
        region form one run; every frame carries its run's span, which the receiver checks whole,
        so a run is refused entirely or not at all (like one RDMA work request). Pieces of a frame
        contiguous in local memory too become one iovec."""
        self._check_open()
        if not entries:
            raise ValueError("an operation needs at least one entry")
        registry = self._transport._registry
        regions: dict[MemoryRegion, memoryview] = {}  # each local region checked once per call
        frames: list[_Frame] = []
        run: list[_Frame] = []
        tail: tuple[_Frame, MemoryRegion, int, int] | None = None  # last piece: frame, region, span
        for e in entries:
            whole = regions.get(e.local)
            if whole is None:
                whole = tensor_buffer(registry.local_view(e.local, 0, e.local.length))
                if len(whole) != e.local.length:
                    raise LocalAccessError(
                        f"local region {e.local} does not match its registration"
                    )
                regions[e.local] = whole
            cur = run[-1] if run else None
            if cur is None or cur.rkey != e.rkey or cur.addr + cur.length != e.remote_addr:
                _close_run(run)
                run = []
            off = 0
            while off < e.length:
                cur = run[-1] if run else None
                if cur is None or cur.length >= self._slice or len(cur.views) >= MAX_IOV:
                    cur = _Frame(kind, e.rkey, e.remote_addr + off)
                    run.append(cur)
                    frames.append(cur)
                take = min(e.length - off, self._slice - cur.length)
                start = e.local_offset + off  # WriteEntry checked the bounds
                if tail and tail[0] is cur and tail[1] == e.local and tail[3] == start:
                    cur.views[-1] = whole[tail[2] : start + take]  # locally contiguous: merge
                    tail = (cur, e.local, tail[2], start + take)
                else:
                    cur.views.append(whole[start : start + take])
                    tail = (cur, e.local, start, start + take)
                cur.length += take
                off += take
        _close_run(run)
        return frames

    def _post(self, frames: list[_Frame], seq: int, imm: int) -> _Op:
        """Queue every frame of one operation at once (so per-lane order is call order), each on
        the lane with the fewest outstanding bytes; the lanes' send threads pace them."""
        op = _Op(self._loop.create_future(), len(frames))
        self._ops.add(op)
        count = len(frames)
        for idx, frame in enumerate(frames):
            frame.op, frame.seq, frame.idx, frame.count, frame.imm = (
                op,
                seq,
                idx,
                count,
                imm,
            )
            lane = min(self._lanes, key=lambda lane: lane.queued - lane.acked)
            lane.queued += frame.length
            lane.sends.put(frame)
        return op

    async def _wait(self, op: _Op, prev: asyncio.Task[None] | None) -> None:
        """Wait for ``op``'s ACKs, then for ``prev``: a write returns only when every earlier
        write settled, so its completion is queued."""
        try:
            await asyncio.wait_for(asyncio.shield(op.future), self._op_timeout_s)
            if prev is not None:
                await asyncio.wait({prev})  # its own error went to its own caller
                self._check_open()
        except TimeoutError:
            error = PeerGoneError(
                f"tcp peer {self._peer_id} at {self._address[0]}:{self._address[1]} did not "
                f"acknowledge within {self._op_timeout_s} s (op_timeout_s); endpoint closed"
            )
            self._break(error)
            raise error from None
        finally:
            self._ops.discard(op)
            if op.future.done() and not op.future.cancelled():
                op.future.exception()  # retrieved: raised above or superseded by another error

    # -- lane threads ------------------------------------------------------------------------------

    def _send_loop(self, lane: _Lane) -> None:
        """Send queued frames within the lane's window: as many as the window admits leave in one
        ``sendmsg``. Most frames go out with ``FLAG_NO_ACK``; one every window/4 bytes and the
        last of each batch ask for the (cumulative) ACK, so whenever this thread waits, every
        frame it has sent is covered by an ACK on its way."""
        ack_every = max(1, lane.window.limit // ACKS_PER_WINDOW)
        since_ack = 0  # bytes sent since the last frame that asked for an ACK
        held: _Frame | None = None  # dequeued, not yet admitted by the window
        while True:
            frame = held if held is not None else lane.sends.get()
            held = None
            if frame is None or not lane.window.take(frame.length):
                return  # the endpoint broke or closed
            batch, num_iov = [frame], _num_iov(frame)
            while True:
                try:
                    frame = lane.sends.get_nowait()
                except queue.Empty:
                    break
                if frame is None:
                    return
                n = _num_iov(frame)
                if num_iov + n > MAX_BATCH_IOV or not lane.window.take(frame.length, block=False):
                    held = frame
                    break
                batch.append(frame)
                num_iov += n
            buffers: list[memoryview] = []
            for i, f in enumerate(batch):
                since_ack += f.length
                ask = i == len(batch) - 1 or since_ack >= ack_every or f.kind == OP_READ
                since_ack = 0 if ask else since_ack
                buffers.append(memoryview(f.header(0 if ask else FLAG_NO_ACK)))
                if f.kind == OP_WRITE:
                    buffers += f.views
            with lane.lock:
                lane.unacked.extend(batch)
            try:
                send_all(lane.sock, buffers)
            except OSError as exc:
                self._lost(lane, f"send failed: {exc}")
                return

    def _ack_loop(self, lane: _Lane) -> None:
        """Settle frames as ACKs arrive: an ACK (or NAK) covers its frame and every frame the lane
        sent before it; credit goes straight back to the window, and the event loop is called
        only for operations that are done."""
        buf = bytearray(ACK.size)
        view = memoryview(buf)
        try:
            while True:
                got = recv_exact(lane.sock, view)
                if got != ACK.size:
                    self._lost(lane, "connection closed by the receiver")
                    return
                magic, status, kind, _, idx, seq, length = ACK.unpack(buf)
                if magic != MAGIC_ACK or not (status == 0 or status in _REASONS):
                    raise ProtocolError(f"unexpected ack {bytes(buf)!r}")
                done = lane.settle(kind, seq, idx)
                frame = done[-1]
                if kind == OP_READ and status == 0:
                    if length != frame.length:
                        raise ProtocolError(f"read reply of {length} bytes, asked {frame.length}")
                    for piece in frame.views:
                        if recv_exact(lane.sock, piece) != len(piece):
                            self._lost(lane, "connection closed during a read reply")
                            return
                num_bytes = sum(f.length for f in done)
                lane.acked += num_bytes
                lane.window.give(num_bytes, len(done))
                self._settle(done, status)
        except (OSError, ProtocolError) as exc:
            self._lost(lane, str(exc))

    def _settle(self, done: list[_Frame], status: int) -> None:
        """Book settled frames (all placed but the last, which has ``status``)."""
        finished: list[_Op] = []
        with self._lock:
            for frame in done:
                op = frame.op
                assert op is not None
                op.remaining -= 1
                if op.remaining == 0:
                    finished.append(op)
            last = done[-1]
            if status and last.op is not None and last.op.error is None:
                last.op.error = RemoteAccessError(
                    RefusalReason(status),
                    f"peer {self._peer_id}, remote addr {last.addr:#x}",
                )
        if finished:
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._loop.call_soon_threadsafe(self._finish, finished)

    def _lost(self, lane: _Lane, reason: str) -> None:
        error = PeerGoneError(
            f"tcp peer {self._peer_id} at {self._address[0]}:{self._address[1]} went away "
            f"(lane {lane.index}: {reason}); in-flight writes may be partially placed and are "
            "not completed on the receiver: reconnect and resend"
        )
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._break, error)

    # -- event loop --------------------------------------------------------------------------------

    def _finish(self, ops: list[_Op]) -> None:
        for op in ops:
            if op.future.done():
                continue  # already failed by _break
            if op.error is None:
                op.future.set_result(None)
            else:
                op.future.set_exception(op.error)

    def _break(self, error: TransportError) -> None:
        """Fail everything in flight, stop the lanes; later calls raise ``error``."""
        if self._broken is None:
            self._broken = error
        for op in self._ops:
            if not op.future.done():
                op.future.set_exception(self._broken)
        for lane in self._lanes:
            with lane.lock:
                lane.unacked.clear()
            lane.sends.put(None)
            lane.window.close()  # wakes a send thread waiting for credit
            with contextlib.suppress(OSError):
                lane.sock.shutdown(socket.SHUT_RDWR)


_REASONS = frozenset(int(r) for r in RefusalReason)


def _num_iov(frame: _Frame) -> int:
    return 1 + len(frame.views) if frame.kind == OP_WRITE else 1


__all__ = ["TcpEndpoint"]
