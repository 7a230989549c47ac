"""Lanes of the tcp backend's writer: one socket each, with a send thread and an ACK thread.

The send thread takes window credit for each queued frame and sends as many frames as the window
admits in one ``sendmsg``; the ACK thread settles frames (oldest first: ACKs are cumulative) and
gives their credit back. Neither waits on the event loop: they report settled frames and a lost
lane to the endpoint through the callbacks they are given.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections import deque
from collections.abc import Callable

from kvmesh.shared.transport.errors import ProtocolError, RefusalReason
from kvmesh.shared.transport.server import recv_exact
from kvmesh.shared.transport.tcp import (
    ACK,
    FLAG_NO_ACK,
    FRAME,
    MAGIC_ACK,
    MAGIC_FRAME,
    OP_PING,
    OP_READ,
    OP_WRITE,
    VERSION,
    send_all,
)
from kvmesh.shared.transport.tcp_frames import Frame
from kvmesh.shared.transport.threads import Window

MAX_BATCH_IOV = 1024  # iovecs per sendmsg (IOV_MAX on Linux)
# a lane asks for an ACK at least every window/4 bytes, and ends each sendmsg batch with one
ACKS_PER_WINDOW = 4


class Lane:
    """One socket: frames queued by the event loop, sent by its send thread within ``window``
    bytes, and settled (oldest first: ACKs are cumulative) by its ACK thread."""

    __slots__ = ("acked", "index", "lock", "queued", "sends", "sock", "unacked", "window")

    def __init__(self, index: int, sock: socket.socket, window_bytes: int) -> None:
        self.index = index
        self.sock = sock
        self.window = Window(window_bytes)
        self.sends: queue.SimpleQueue[Frame | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.unacked: deque[Frame] = deque()  # sent, in send order
        self.queued = 0  # bytes ever queued (event loop) ...
        self.acked = 0  # ... and ever settled (ACK thread): the difference is outstanding

    def settle(self, kind: int, seq: int, idx: int) -> list[Frame]:
        """Frames covered by the ACK of ``(kind, seq, idx)``: it and every frame sent before it."""
        done: list[Frame] = []
        with self.lock:
            while self.unacked:
                frame = self.unacked.popleft()
                done.append(frame)
                if frame.idx == idx and frame.seq == seq and frame.kind == kind:
                    return done
        raise ProtocolError(f"ack for a frame never sent (op {kind}, seq {seq}, frame {idx})")


PING = FRAME.pack(MAGIC_FRAME, VERSION, OP_PING, FLAG_NO_ACK, 0, 0, 0, 0, 0, 0, 1, 0, 0)


def send_loop(lane: Lane, lost: Callable[[Lane, str], None], keepalive_s: float) -> None:
    """Send queued frames within the lane's window: as many as the window admits leave in one
    ``sendmsg``. Most frames go out with ``FLAG_NO_ACK``; one every window/4 bytes and the
    last of each batch ask for the (cumulative) ACK, so whenever this thread waits, every
    frame it has sent is covered by an ACK on its way. A lane with nothing to send for
    ``keepalive_s`` sends a ping, so the receiver's idle timeout spares it."""
    ack_every = max(1, lane.window.limit // ACKS_PER_WINDOW)
    since_ack = 0  # bytes sent since the last frame that asked for an ACK
    held: Frame | None = None  # dequeued, not yet admitted by the window
    while True:
        if held is not None:
            frame: Frame | None = held
        else:
            try:
                frame = lane.sends.get(timeout=keepalive_s)
            except queue.Empty:
                try:
                    send_all(lane.sock, [memoryview(PING)])
                except OSError as exc:
                    lost(lane, f"send failed: {exc}")
                    return
                continue
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
            lost(lane, f"send failed: {exc}")
            return


def ack_loop(
    lane: Lane,
    settle: Callable[[list[Frame], int], None],
    lost: Callable[[Lane, str], None],
) -> None:
    """Settle frames as ACKs arrive: an ACK (or NAK) covers its frame and every frame the lane
    sent before it; credit goes straight back to the window, and the event loop is called
    only for operations that are done."""
    buf = bytearray(ACK.size)
    view = memoryview(buf)
    try:
        while True:
            got = recv_exact(lane.sock, view)
            if got != ACK.size:
                lost(lane, "connection closed by the receiver")
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
                        lost(lane, "connection closed during a read reply")
                        return
            num_bytes = sum(f.length for f in done)
            lane.acked += num_bytes
            lane.window.give(num_bytes, len(done))
            settle(done, status)
    except (OSError, ProtocolError) as exc:
        lost(lane, str(exc))


_REASONS = frozenset(int(r) for r in RefusalReason)


def _num_iov(frame: Frame) -> int:
    return 1 + len(frame.views) if frame.kind == OP_WRITE else 1


__all__ = ["ACKS_PER_WINDOW", "MAX_BATCH_IOV", "Lane", "ack_loop", "send_loop"]
