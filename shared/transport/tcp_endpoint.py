"""Writer side of the tcp backend: one endpoint = several lanes (sockets) to one receiver.

Per lane a sender thread (``sendmsg`` header + payload pieces) and an ACK thread (``recv_into``);
the event loop only cuts writes into frames, waits for window credit and books ACKs.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import secrets
import socket
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from shared.transport.base import (
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
from shared.transport.threads import ThreadSet

if TYPE_CHECKING:
    from shared.transport.tcp import TcpTransport

MAX_IOV = 512  # payload pieces per frame (IOV_MAX is 1024)


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

    def header(self) -> bytes:
        return FRAME.pack(
            MAGIC_FRAME, VERSION, self.kind, 0, self.rkey, self.imm, self.addr, self.length,
            self.seq, self.idx, self.count, self.span_addr, self.span_len,
        )  # fmt: skip


def _background(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Operations run to their end even if the caller is cancelled (callers await them shielded):
    a half-sent write would make the receiver wait for its missing frames forever and hold back
    every later completion."""
    task = asyncio.ensure_future(coro)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _close_run(run: list[_Frame]) -> None:
    if run:
        span = (run[0].addr, run[-1].addr + run[-1].length - run[0].addr)
        for frame in run:
            frame.span_addr, frame.span_len = span


class _Lane:
    __slots__ = ("credit", "in_flight", "index", "outstanding", "peak", "pending", "sends", "sock")

    def __init__(self, index: int, sock: socket.socket, window: int) -> None:
        self.index = index
        self.sock = sock
        self.credit = asyncio.Semaphore(window)
        self.sends: queue.SimpleQueue[_Frame | None] = queue.SimpleQueue()
        self.pending: dict[tuple[int, int, int], _Frame] = {}
        self.in_flight = self.peak = self.outstanding = 0


class TcpEndpoint:
    backend = "tcp"

    def __init__(self, transport: TcpTransport, descriptor: PeerDescriptor) -> None:
        self._transport = transport
        self._peer_id = descriptor.peer_id
        info = descriptor.backends["tcp"]
        self._address = (str(info["host"]), int(info["port"]))
        self._window = transport.config.tcp_window
        self._slice = transport.config.tcp_slice_bytes
        self._op_timeout_s = transport.config.op_timeout_s
        self._lanes: list[_Lane] = []
        self._threads = ThreadSet()
        self._loop = asyncio.get_running_loop()
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
                    socket.create_connection, ep._address, transport.config.connect_timeout_s
                )
                sock.settimeout(None)
                tune(sock)
                sock.sendall(
                    HELLO.pack(MAGIC_HELLO, VERSION, i, num_lanes, endpoint_id, len(hello_id))
                    + hello_id
                )
                ep._lanes.append(_Lane(i, sock, ep._window))
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
    def max_in_flight(self) -> int:
        """Most frames ever in flight on one lane (never above the window)."""
        return max(lane.peak for lane in self._lanes)

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
        prev = self._last_write
        task = self._last_write = _background(self._run(frames, self._write_seq, imm, prev))
        await asyncio.shield(task)

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        frames = self._frames(entries, OP_READ)
        self._read_seq += 1
        await asyncio.shield(_background(self._run(frames, self._read_seq, 0, None)))

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise TransportClosedError(f"endpoint to {self._peer_id} is closed")

    def _frames(self, entries: Sequence[WriteEntry], kind: int) -> list[_Frame]:
        """Cut entries into frames of at most ``slice`` bytes. Entries contiguous in the remote
        region form one run; every frame carries its run's span, which the receiver checks whole,
        so a run is refused entirely or not at all (like one RDMA work request)."""
        self._check_open()
        if not entries:
            raise ValueError("an operation needs at least one entry")
        registry = self._transport._registry
        frames: list[_Frame] = []
        run: list[_Frame] = []
        for e in entries:
            local = registry.local_view(e.local, e.local_offset, e.length)
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
                cur.views.append(tensor_buffer(local[off : off + take]))
                cur.length += take
                off += take
        _close_run(run)
        return frames

    async def _run(
        self, frames: list[_Frame], seq: int, imm: int, prev: asyncio.Task[None] | None
    ) -> None:
        """Send ``frames`` within the lanes' windows and wait for their ACKs, then for ``prev``:
        a write returns only when every earlier write settled, so its completion is queued."""
        op = _Op(self._loop.create_future(), len(frames))
        for idx, frame in enumerate(frames):
            frame.op, frame.seq, frame.idx, frame.count, frame.imm = op, seq, idx, len(frames), imm
        try:
            for frame in frames:
                lane = min(self._lanes, key=lambda lane: lane.outstanding)
                lane.outstanding += frame.length
                await lane.credit.acquire()  # backpressure: at most `window` frames per lane
                self._check_open()
                lane.in_flight += 1
                lane.peak = max(lane.peak, lane.in_flight)
                lane.pending[(frame.kind, frame.seq, frame.idx)] = frame
                lane.sends.put(frame)
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
            if op.future.done() and not op.future.cancelled():
                op.future.exception()  # retrieved: raised above or superseded by another error

    # -- lane threads ------------------------------------------------------------------------------

    def _send_loop(self, lane: _Lane) -> None:
        """Frames queued together leave in one ``sendmsg`` (headers and payload pieces)."""
        while (frame := lane.sends.get()) is not None:
            buffers: list[memoryview] = []
            stop = False
            while True:
                buffers.append(memoryview(frame.header()))
                if frame.kind == OP_WRITE:
                    buffers += frame.views
                if len(buffers) >= MAX_IOV:
                    break
                try:
                    frame = lane.sends.get_nowait()
                except queue.Empty:
                    break
                if frame is None:
                    stop = True
                    break
            try:
                send_all(lane.sock, buffers)
            except OSError as exc:
                self._lost(lane, f"send failed: {exc}")
                return
            if stop:
                return

    def _ack_loop(self, lane: _Lane) -> None:
        buf = bytearray(ACK.size)
        view = memoryview(buf)
        try:
            while True:
                got = recv_exact(lane.sock, view)
                if got != ACK.size:
                    self._lost(lane, "connection closed by the receiver")
                    return
                magic, status, kind, _, idx, seq, length = ACK.unpack(buf)
                frame = lane.pending.pop((kind, seq, idx), None)
                if magic != MAGIC_ACK or frame is None:
                    raise ProtocolError(f"unexpected ack {bytes(buf)!r}")
                if kind == OP_READ and status == 0:
                    if length != frame.length:
                        raise ProtocolError(f"read reply of {length} bytes, asked {frame.length}")
                    for piece in frame.views:
                        if recv_exact(lane.sock, piece) != len(piece):
                            self._lost(lane, "connection closed during a read reply")
                            return
                self._loop.call_soon_threadsafe(self._on_ack, lane, frame, status)
        except (OSError, ProtocolError) as exc:
            self._lost(lane, str(exc))

    def _lost(self, lane: _Lane, reason: str) -> None:
        error = PeerGoneError(
            f"tcp peer {self._peer_id} at {self._address[0]}:{self._address[1]} went away "
            f"(lane {lane.index}: {reason}); in-flight writes may be partially placed and are "
            "not completed on the receiver: reconnect and resend"
        )
        with contextlib.suppress(RuntimeError):  # loop already closed
            self._loop.call_soon_threadsafe(self._break, error)

    # -- event loop bookkeeping --------------------------------------------------------------------

    def _on_ack(self, lane: _Lane, frame: _Frame, status: int) -> None:
        lane.in_flight -= 1
        lane.outstanding -= frame.length
        lane.credit.release()
        op = frame.op
        assert op is not None
        if status and op.error is None:
            op.error = RemoteAccessError(
                RefusalReason(status), f"peer {self._peer_id}, remote addr {frame.addr:#x}"
            )
        op.remaining -= 1
        if op.remaining == 0 and not op.future.done():
            if op.error is None:
                op.future.set_result(None)
            else:
                op.future.set_exception(op.error)

    def _break(self, error: TransportError) -> None:
        """Fail everything in flight, stop the lanes; later calls raise ``error``."""
        if self._broken is None:
            self._broken = error
        for lane in self._lanes:
            for frame in lane.pending.values():
                if frame.op is not None and not frame.op.future.done():
                    frame.op.future.set_exception(self._broken)
            lane.pending.clear()
            lane.sends.put(None)
            for _ in range(self._window):  # wake writers waiting for credit
                lane.credit.release()
            with contextlib.suppress(OSError):
                lane.sock.shutdown(socket.SHUT_RDWR)


__all__ = ["TcpEndpoint"]
