"""The tcp backend's receiving side: serves each admitted lane (its hello proven by the
server, ``server.py`` + ``lane_auth.py``), frame by frame.

A frame header is checked against the registry *before* its payload is read; the payload is
``recv_into``'d straight into the registered memory, or drained if refused, and ACKed unless the
writer flagged it ``FLAG_NO_ACK`` (ACKs are cumulative per lane). Every refusal is NAKed
``REFUSED`` alike (the reason goes to the log). A corrupt or truncated frame, a frame that stalls,
a lane idle past ``idle_timeout_s`` and an endpoint with ``max_refusals`` refused operations are
dropped with all the endpoint's lanes. Every refused operation also spends its source address's
refusal budget (``source_budget``): once that is spent, each further refusal from the source
ends its lane, and the server resets the source's new connections for a while. A write's
completion is delivered when all its frames are placed, in per-endpoint write order.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.base import Access
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import ProtocolError, RefusalReason, RemoteAccessError
from kvmesh.shared.transport.lane_auth import LaneHello
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.source_budget import SourceGuard, source_of
from kvmesh.shared.transport.tcp import (
    ACK,
    DRAIN_BYTES,
    FLAG_NO_ACK,
    FRAME,
    MAGIC_ACK,
    MAGIC_FRAME,
    MAX_FRAME_BYTES,
    MAX_PENDING_WRITES,
    MIN_FRAME_BYTES_PER_S,
    OP_PING,
    OP_READ,
    OP_WRITE,
    VERSION,
    send_all,
    set_io_timeout,
    tensor_buffer,
)

log = logs.get_logger(__name__)


@dataclass
class _WriteState:
    """Receiver-side progress of one write (all its frames, across lanes)."""

    imm: int
    num_frames: int
    rkey: int  # the key its frames used (a write with frames of several keys: the first's)
    frames: int = 0
    num_bytes: int = 0
    refused: bool = False
    reason: str = ""  # why its first refused frame was refused (for the log)


@dataclass
class _PeerEndpoint:
    """Receiver-side state of one writer endpoint: its lanes and the completion order."""

    peer_id: str
    lanes: set[socket.socket] = field(default_factory=set)
    next_seq: int = 1
    pending: dict[int, _WriteState] = field(default_factory=dict)
    dead: bool = False
    refusals: int = 0  # operations refused (a write counts once however many frames it has)


class TcpReceiver:
    """The lanes one tcp transport serves: their writer endpoints and the completion order."""

    def __init__(
        self,
        config: TransportConfig,
        registry: Registry,
        queue: CompletionQueue,
        guard: SourceGuard | None = None,
    ) -> None:
        self.config = config
        self._guard = guard
        self._registry = registry
        self._queue = queue
        self._lock = threading.Lock()
        self.peers: dict[tuple[str, int], _PeerEndpoint] = {}
        self.num_dropped = 0  # lanes dropped (idle, stalled, corrupt, too many refusals)

    def serve_lane(self, conn: socket.socket, hello: LaneHello) -> None:
        """Serve one admitted lane (its hello proven by the server) until it ends."""
        with self._lock:
            key = (hello.peer_id, hello.endpoint_id)
            peer = self.peers.setdefault(key, _PeerEndpoint(hello.peer_id))
            peer.lanes.add(conn)
        try:
            source = source_of(conn.getpeername())
            set_io_timeout(conn, min(self.config.stall_timeout_s, self.config.idle_timeout_s))
            self._frames(conn, peer, source)
        except (OSError, ProtocolError) as exc:
            if logs.is_sampled(self._count_dropped()):
                log.info("tcp lane dropped", peer=peer.peer_id, reason=str(exc))
        finally:
            self._drop(peer)

    def _count_dropped(self) -> int:
        with self._lock:
            self.num_dropped += 1
            return self.num_dropped

    def _drop(self, peer: _PeerEndpoint) -> None:
        """A lane died: the endpoint's order is broken, so close all of its lanes."""
        with self._lock:
            peer.dead = True
            lanes = list(peer.lanes)
            peer.pending.clear()
            for key, value in list(self.peers.items()):
                if value is peer:
                    del self.peers[key]
        for lane in lanes:
            with contextlib.suppress(OSError):
                lane.shutdown(socket.SHUT_RDWR)

    def _recv_header(self, conn: socket.socket, view: memoryview) -> int:
        """The next frame header (0 on a clean end). Waits up to idle_timeout_s for its first
        byte (writers ping more often), then stall_timeout_s for the rest."""
        got, idle_since, deadline = 0, time.monotonic(), 0.0
        while got < len(view):
            try:
                r = conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
            except BlockingIOError:
                r = -1
            now = time.monotonic()
            if r == 0:
                return got
            if r > 0:
                deadline = deadline or now + self.config.stall_timeout_s
                got += r
            elif not got and now - idle_since >= self.config.idle_timeout_s:
                raise ProtocolError(f"lane idle for {self.config.idle_timeout_s} s")
            if got and got < len(view) and now > deadline:
                raise ProtocolError("frame header stalled")
        return got

    def _recv_payload(self, conn: socket.socket, view: memoryview) -> None:
        """Fill ``view`` or raise: a frame that stalls is dropped (with its endpoint)."""
        n = len(view)
        deadline = time.monotonic() + self.config.stall_timeout_s + n / MIN_FRAME_BYTES_PER_S
        got = 0
        while got < n:
            try:
                r = conn.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            except BlockingIOError:
                r = -1
            if r == 0:
                raise ProtocolError("truncated payload")
            got += max(r, 0)
            if got < n and time.monotonic() > deadline:
                raise ProtocolError(f"frame of {n} bytes stalled after {got}")

    def _frames(self, conn: socket.socket, peer: _PeerEndpoint, source: str) -> None:
        hdr = bytearray(FRAME.size)
        hview = memoryview(hdr)
        scratch = None
        while True:
            got = self._recv_header(conn, hview)
            if got == 0:
                return
            if got != FRAME.size:
                raise ProtocolError("truncated frame header")
            magic, version, op, flags, rkey, imm, addr, length, seq, idx, count, span, span_len = (
                FRAME.unpack(hdr)
            )
            if magic != MAGIC_FRAME or version != VERSION or op not in (OP_WRITE, OP_READ, OP_PING):
                raise ProtocolError(f"corrupt frame header {bytes(hdr)!r}")
            if op == OP_PING:
                if length:
                    raise ProtocolError(f"a ping of {length} bytes")
                continue
            if not 0 < length <= MAX_FRAME_BYTES or not idx < count:
                raise ProtocolError(f"insane frame length {length} or index {idx}/{count}")
            if not span <= addr <= addr + length <= span + span_len:
                raise ProtocolError(f"frame [{addr:#x}, +{length}) outside its span")
            access = Access.REMOTE_WRITE if op == OP_WRITE else Access.REMOTE_READ
            view, error = self._target(rkey, span, span_len, access)
            # Every refusal answers alike (no oracle); the reason goes to the log only.
            status = int(RefusalReason.REFUSED) if error else 0
            if view is not None:
                view = view[addr - span : addr - span + length]
            if op == OP_READ:
                if view is None:
                    assert error is not None
                    self._registry.count_refused(peer.peer_id, error.reason.name)
                    self._refused_op(peer, source)
                    self._send(conn, [memoryview(ACK.pack(MAGIC_ACK, status, op, 0, idx, seq, 0))])
                    continue
                ack = ACK.pack(MAGIC_ACK, 0, op, 0, idx, seq, length)
                self._send(conn, [memoryview(ack), tensor_buffer(view)])
                self._registry.count_read(length, ops=int(idx == count - 1))
                continue
            if view is None:
                scratch = scratch or memoryview(bytearray(DRAIN_BYTES))
                left = length
                while left:
                    n = min(left, DRAIN_BYTES)
                    self._recv_payload(conn, scratch[:n])
                    left -= n
            else:
                self._recv_payload(conn, tensor_buffer(view))
            reason = error.reason.name if error else ""
            self._placed(peer, source, seq, idx, count, imm, rkey, 0 if error else length, reason)
            if error or not flags & FLAG_NO_ACK:
                self._send(conn, [memoryview(ACK.pack(MAGIC_ACK, status, op, 0, idx, seq, length))])

    def _send(self, conn: socket.socket, buffers: list[memoryview]) -> None:
        """Answer a frame; a peer that stops reading its answers is dropped."""
        total = sum(len(b) for b in buffers)
        deadline = time.monotonic() + self.config.stall_timeout_s + total / MIN_FRAME_BYTES_PER_S
        send_all(conn, buffers, deadline)

    def _refused_op(self, peer: _PeerEndpoint, source: str) -> None:
        """One more refused operation: past ``max_refusals`` the endpoint is disconnected (a
        writer that keeps presenting bad keys is probing; an honest one stops at its first),
        and once its source's budget is spent, at each refusal (a prober that opens a fresh
        endpoint per guess is bounded by source, not by endpoint)."""
        with self._lock:
            peer.refusals += 1
            over = peer.refusals >= self.config.max_refusals
        if self._guard is not None and self._guard.refused(source):
            raise ProtocolError(f"source {source} spent its refusals: blocked, disconnected")
        if over:
            raise ProtocolError(f"{peer.refusals} accesses refused: disconnected")

    def _target(
        self, rkey: int, addr: int, length: int, access: Access
    ) -> tuple[torch.Tensor | None, RemoteAccessError | None]:
        """The registered bytes a frame's span may touch, or why not (checked before any read)."""
        try:
            return self._registry.remote_view(rkey, addr, length, access), None
        except RemoteAccessError as error:
            return None, error

    def _placed(
        self,
        peer: _PeerEndpoint,
        source: str,
        seq: int,
        idx: int,
        count: int,
        imm: int,
        rkey: int,
        num_bytes: int,
        reason: str = "",
    ) -> None:
        """Book one frame (num_bytes 0: refused, for ``reason``); deliver completed writes in
        seq order. Raises ProtocolError once the endpoint has too many refusals."""
        done: list[_WriteState] = []
        first_refusal = False
        with self._lock:
            if peer.dead:
                return
            state = peer.pending.get(seq)
            if state is None:
                if not peer.next_seq <= seq < peer.next_seq + MAX_PENDING_WRITES:
                    raise ProtocolError(
                        f"write seq {seq} outside [{peer.next_seq}, +{MAX_PENDING_WRITES})"
                    )
                state = peer.pending[seq] = _WriteState(imm=imm, num_frames=count, rkey=rkey)
            state.frames += 1
            state.num_bytes += num_bytes
            if num_bytes == 0 and not state.refused:
                state.refused, state.reason, first_refusal = True, reason, True
            while (head := peer.pending.get(peer.next_seq)) and head.frames == head.num_frames:
                del peer.pending[peer.next_seq]
                peer.next_seq += 1
                done.append(head)
        for state in done:
            if state.refused:
                self._registry.count_refused(peer.peer_id, f"write: {state.reason}")
            else:
                self._registry.count_write(state.num_bytes)
                keys = frozenset((state.rkey,))
                self._queue.put(Completion(state.imm, peer.peer_id, state.num_bytes, keys))
        if first_refusal:
            self._refused_op(peer, source)
