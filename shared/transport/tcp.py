"""Cross-host backend: framed one-sided writes over several TCP lanes per endpoint.

Every frame carries a fixed header (magic, version, op, rkey, imm, remote address, length, write
sequence number, frame index / count). The receiver checks the header against its registry
*before* reading the payload, then ``recv_into``s the payload straight into the registered memory
and ACKs it unless the writer flagged it ``FLAG_NO_ACK`` (ACKs are cumulative per lane); a refused
frame is drained into a scratch buffer and NAKed with the reason; a corrupt, oversized or truncated
frame closes the endpoint. A write is cut into frames of at most ``tcp_slice_bytes`` (contiguous
remote runs are coalesced, scattered local pieces go out with one ``sendmsg``) spread over the
lanes; its Completion is delivered when all its frames are placed, in per-endpoint write order.
Each lane has at most ``tcp_window * tcp_slice_bytes`` bytes in flight.

Blocking sockets in threads: ``sendmsg`` / ``recv_into`` release the GIL, so lanes run in parallel
and the event loop only books ACKs.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvmesh.shared import logs
from kvmesh.shared.advertise import default_route_address
from kvmesh.shared.transport import lane_auth
from kvmesh.shared.transport.base import (
    Access,
    Buffer,
    MemoryRegion,
    MemoryWindow,
    PeerDescriptor,
    TransportStats,
    local_host_id,
    new_peer_id,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
)
from kvmesh.shared.transport.lane_auth import LaneHello
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.server import SocketServer

if TYPE_CHECKING:
    from kvmesh.shared.transport.tcp_endpoint import TcpEndpoint

log = logs.get_logger(__name__)

MAGIC_FRAME, MAGIC_ACK = b"KVMF", b"KVMA"
VERSION = lane_auth.VERSION
OP_WRITE, OP_READ, OP_PING = 1, 2, 3  # a ping (length 0, no payload, no answer) keeps a lane alive
# Frame flag: the writer needs no ACK for this frame (a later frame's ACK covers it; ACKs are
# cumulative per lane). Refused frames and reads are always answered.
FLAG_NO_ACK = 1
MAX_FRAME_BYTES = 1 << 30  # a longer frame is corrupt: close the connection
# FRAME: magic, version, op, flags, rkey, imm, remote_addr, length, seq, frame index, frame count,
# span addr, span length (the remote run this frame belongs to; checked whole)
FRAME = struct.Struct("<4sBBHIIQQQIIQQ")
# ACK: magic, status (0 ok, else RefusalReason.REFUSED), op, pad, frame index, seq, length
# (+ read payload)
ACK = struct.Struct("<4sBBHIQQ")
# A frame's bytes must keep coming: after stall_timeout_s of grace, at least this fast.
MIN_FRAME_BYTES_PER_S = 16 << 20
DRAIN_BYTES = 1 << 20
# Writes a peer may have partly placed at once (each costs the receiver a small record): a peer
# that starts more is disconnected. Writers hold at most this many writes in flight per
# endpoint, so an honest one never trips it.
MAX_PENDING_WRITES = 1024


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """Writable memoryview over a contiguous uint8 CPU tensor (no copy)."""
    return memoryview(t.numpy()).cast("B")


def send_all(sock: socket.socket, buffers: list[memoryview], deadline: float | None = None) -> None:
    """sendmsg until every buffer is out (partial sends resume mid-buffer). With a deadline (a
    receiver's socket has SO_SNDTIMEO), a peer that stops reading past it is a ProtocolError."""
    while buffers:
        if deadline is not None and time.monotonic() > deadline:
            raise ProtocolError("the peer stopped reading")
        try:
            sent = sock.sendmsg(buffers)
        except BlockingIOError:
            if deadline is None:
                raise
            continue
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO and SO_SNDTIMEO on a blocking socket: a recv or send that waits this long
    returns short or raises BlockingIOError, and the caller decides (the fast path stays one
    blocking MSG_WAITALL call)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


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


class TcpTransport:
    """TCP transport; use as ``async with TcpTransport(config) as t``."""

    name = "tcp"

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        registry: Registry | None = None,
        completions: CompletionQueue | None = None,
    ) -> None:
        self.config = config or TransportConfig()
        self._peer_id = self.config.peer_id or new_peer_id()
        self._registry = registry if registry is not None else Registry()
        self._queue = completions if completions is not None else CompletionQueue()
        self._server: SocketServer | None = None
        self._port = 0
        self._lock = threading.Lock()
        self._peers: dict[tuple[str, int], _PeerEndpoint] = {}
        self._memory: list[mmap.mmap] = []
        self._endpoints: set[TcpEndpoint] = set()
        self._closed = False
        # Lanes prove they know it (lane_auth); it travels only in this transport's descriptor.
        self._secret = lane_auth.new_secret()
        self.num_dropped = 0  # lanes dropped (idle, stalled, corrupt, too many refusals)

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def port(self) -> int:
        return self._port

    @property
    def completion_queue(self) -> CompletionQueue:
        return self._queue

    async def __aenter__(self) -> TcpTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._server is not None:
            return
        family = socket.AF_INET6 if ":" in self.config.tcp_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.tcp_host, self.config.tcp_port))
        listener.listen(128)
        self._port = listener.getsockname()[1]
        secret = self._secret
        self._server = SocketServer(
            listener,
            self._serve_lane,
            "tcp-lane",
            lambda: lane_auth.HelloReader(secret),
            on_admit=tune,
            accept_reply=lane_auth.ACCEPT,
            limits=self.config.server_limits(),
        )
        self._server.start()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for ep in list(self._endpoints):
            await ep.aclose()
        if self._server is not None:
            await self._server.aclose()
        for mm in self._memory:
            with contextlib.suppress(BufferError):  # still viewed (a KVPool): freed with its views
                mm.close()
        self._queue.close()

    # -- memory ------------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Page-aligned, zeroed anonymous memory as a flat uint8 tensor."""
        if nbytes <= 0:
            raise ValueError(f"allocate needs a positive size, got {nbytes}")
        mm = mmap.mmap(-1, nbytes)
        self._memory.append(mm)
        return torch.frombuffer(mm, dtype=torch.uint8)

    def register(self, memory: Buffer, access: Access = Access.LOCAL) -> MemoryRegion:
        return self._registry.register(memory, access)

    def deregister(self, region: MemoryRegion) -> None:
        self._registry.deregister(region)

    def open_window(
        self,
        region: MemoryRegion,
        spans: Sequence[tuple[int, int]],
        access: Access = Access.REMOTE_WRITE,
    ) -> MemoryWindow:
        return self._registry.open_window(region, spans, access)

    def close_window(self, window: MemoryWindow) -> None:
        self._registry.close_window(window)

    def descriptor(self) -> PeerDescriptor:
        if self._server is None:
            raise TransportClosedError("enter the transport before asking for its descriptor")
        host = self.config.tcp_advertise_host or self.config.tcp_host
        if host in ("0.0.0.0", "::"):  # every interface: advertise the default route's
            host = default_route_address()
        return PeerDescriptor(
            peer_id=self._peer_id,
            host_id=local_host_id(),
            backends={
                "tcp": {
                    "host": host,
                    "port": self._port,
                    "lanes": self.config.tcp_lanes,
                    "secret": self._secret.hex(),
                }
            },
            regions=tuple(self._registry.regions(Access.REMOTE_WRITE)),
        )

    async def connect(self, descriptor: PeerDescriptor) -> TcpEndpoint:
        from kvmesh.shared.transport.tcp_endpoint import TcpEndpoint

        if self._closed:
            raise TransportClosedError("tcp transport is closed")
        ep = await TcpEndpoint.open(self, descriptor)
        self._endpoints.add(ep)
        return ep

    def completions(self) -> AsyncIterator[Completion]:
        return aiter(self._queue)

    def stats(self) -> TransportStats:
        return self._registry.stats()

    # -- receiver ----------------------------------------------------------------------------------

    def _serve_lane(self, conn: socket.socket, hello: LaneHello) -> None:
        """Serve one admitted lane (its hello proven by the server) until it ends."""
        with self._lock:
            key = (hello.peer_id, hello.endpoint_id)
            peer = self._peers.setdefault(key, _PeerEndpoint(hello.peer_id))
            peer.lanes.add(conn)
        try:
            set_io_timeout(conn, min(self.config.stall_timeout_s, self.config.idle_timeout_s))
            self._frames(conn, peer)
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
            for key, value in list(self._peers.items()):
                if value is peer:
                    del self._peers[key]
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

    def _frames(self, conn: socket.socket, peer: _PeerEndpoint) -> None:
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
                    self._refused_op(peer)
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
            self._placed(peer, seq, idx, count, imm, rkey, 0 if error else length, reason)
            if error or not flags & FLAG_NO_ACK:
                self._send(conn, [memoryview(ACK.pack(MAGIC_ACK, status, op, 0, idx, seq, length))])

    def _send(self, conn: socket.socket, buffers: list[memoryview]) -> None:
        """Answer a frame; a peer that stops reading its answers is dropped."""
        total = sum(len(b) for b in buffers)
        deadline = time.monotonic() + self.config.stall_timeout_s + total / MIN_FRAME_BYTES_PER_S
        send_all(conn, buffers, deadline)

    def _refused_op(self, peer: _PeerEndpoint) -> None:
        """One more refused operation: past ``max_refusals`` the endpoint is disconnected (a
        writer that keeps presenting bad keys is probing; an honest one stops at its first)."""
        with self._lock:
            peer.refusals += 1
            over = peer.refusals >= self.config.max_refusals
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
            self._refused_op(peer)
