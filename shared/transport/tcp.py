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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvmesh.shared.advertise import default_route_address
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
from kvmesh.shared.transport.errors import ProtocolError, RemoteAccessError, TransportClosedError
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.server import SocketServer, recv_exact

if TYPE_CHECKING:
    from kvmesh.shared.transport.tcp_endpoint import TcpEndpoint

MAGIC_HELLO, MAGIC_FRAME, MAGIC_ACK = b"KVMH", b"KVMF", b"KVMA"
VERSION = 1
OP_WRITE, OP_READ = 1, 2
# Frame flag: the writer needs no ACK for this frame (a later frame's ACK covers it; ACKs are
# cumulative per lane). Refused frames and reads are always answered.
FLAG_NO_ACK = 1
MAX_FRAME_BYTES = 1 << 30  # a longer frame is corrupt: close the connection
# HELLO: magic, version, lane, num_lanes, endpoint id, peer id length (+ peer id bytes)
HELLO = struct.Struct("<4sHHHQH")
# FRAME: magic, version, op, flags, rkey, imm, remote_addr, length, seq, frame index, frame count,
# span addr, span length (the remote run this frame belongs to; checked whole)
FRAME = struct.Struct("<4sBBHIIQQQIIQQ")
# ACK: magic, status (0 ok, else RefusalReason), op, pad, frame index, seq, length (+ read payload)
ACK = struct.Struct("<4sBBHIQQ")
DRAIN_BYTES = 1 << 20
# Writes a peer may have partly placed at once (each costs the receiver a small record): a peer
# that starts more is disconnected. Writers hold at most this many writes in flight per
# endpoint, so an honest one never trips it.
MAX_PENDING_WRITES = 1024


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """Writable memoryview over a contiguous uint8 CPU tensor (no copy)."""
    return memoryview(t.numpy()).cast("B")


def send_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """sendmsg until every buffer is out (partial sends resume mid-buffer)."""
    while buffers:
        sent = sock.sendmsg(buffers)
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if buffers and sent:
            buffers[0] = buffers[0][sent:]


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class _WriteState:
    """Receiver-side progress of one write (all its frames, across lanes)."""

    imm: int
    num_frames: int
    rkey: int  # the key its frames used (a write with frames of several keys: the first's)
    frames: int = 0
    num_bytes: int = 0
    refused: bool = False


@dataclass
class _PeerEndpoint:
    """Receiver-side state of one writer endpoint: its lanes and the completion order."""

    peer_id: str
    lanes: set[socket.socket] = field(default_factory=set)
    next_seq: int = 1
    pending: dict[int, _WriteState] = field(default_factory=dict)
    dead: bool = False


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
        self._server = SocketServer(
            listener,
            self._serve_lane,
            "tcp-lane",
            on_accept=tune,
            max_connections=self.config.max_connections,
            handshake_timeout_s=self.config.handshake_timeout_s,
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
            backends={"tcp": {"host": host, "port": self._port, "lanes": self.config.tcp_lanes}},
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

    def _serve_lane(self, conn: socket.socket) -> None:
        peer: _PeerEndpoint | None = None
        try:
            peer = self._hello(conn)
            if peer is not None:
                self._frames(conn, peer)
        except (OSError, ProtocolError):
            pass  # this endpoint is gone; other peers are served by their own threads
        finally:
            if peer is not None:
                self._drop(peer)

    def _hello(self, conn: socket.socket) -> _PeerEndpoint | None:
        buf = bytearray(HELLO.size)
        if recv_exact(conn, memoryview(buf)) != HELLO.size:
            return None
        magic, version, _lane, _num_lanes, endpoint_id, n = HELLO.unpack(buf)
        if magic != MAGIC_HELLO or version != VERSION or not 0 < n <= 256:
            raise ProtocolError(f"bad hello {bytes(buf)!r}")
        raw = bytearray(n)
        if recv_exact(conn, memoryview(raw)) != n:
            return None
        peer_id = raw.decode(errors="replace")
        conn.settimeout(
            None
        )  # hello complete: lanes may idle between jobs for as long as they like
        with self._lock:
            peer = self._peers.setdefault((peer_id, endpoint_id), _PeerEndpoint(peer_id))
            peer.lanes.add(conn)
        return peer

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

    def _frames(self, conn: socket.socket, peer: _PeerEndpoint) -> None:
        hdr = bytearray(FRAME.size)
        hview = memoryview(hdr)
        scratch = None
        while True:
            got = recv_exact(conn, hview)
            if got == 0:
                return
            if got != FRAME.size:
                raise ProtocolError("truncated frame header")
            magic, version, op, flags, rkey, imm, addr, length, seq, idx, count, span, span_len = (
                FRAME.unpack(hdr)
            )
            if magic != MAGIC_FRAME or version != VERSION or op not in (OP_WRITE, OP_READ):
                raise ProtocolError(f"corrupt frame header {bytes(hdr)!r}")
            if not 0 < length <= MAX_FRAME_BYTES or not idx < count:
                raise ProtocolError(f"insane frame length {length} or index {idx}/{count}")
            if not span <= addr <= addr + length <= span + span_len:
                raise ProtocolError(f"frame [{addr:#x}, +{length}) outside its span")
            access = Access.REMOTE_WRITE if op == OP_WRITE else Access.REMOTE_READ
            view, error = self._target(rkey, span, span_len, access)
            status = int(error.reason) if error else 0
            if view is not None:
                view = view[addr - span : addr - span + length]
            if op == OP_READ:
                if view is None:
                    self._registry.count_refused(peer.peer_id, error.reason.name if error else "")
                    conn.sendall(ACK.pack(MAGIC_ACK, status, op, 0, idx, seq, 0))
                    continue
                ack = ACK.pack(MAGIC_ACK, 0, op, 0, idx, seq, length)
                send_all(conn, [memoryview(ack), tensor_buffer(view)])
                self._registry.count_read(length, ops=int(idx == count - 1))
                continue
            if view is None:
                scratch = scratch or memoryview(bytearray(DRAIN_BYTES))
                left = length
                while left:
                    n = min(left, DRAIN_BYTES)
                    if recv_exact(conn, scratch[:n]) != n:
                        raise ProtocolError("truncated payload")
                    left -= n
            elif recv_exact(conn, tensor_buffer(view)) != length:
                raise ProtocolError("truncated payload")
            self._placed(peer, seq, idx, count, imm, rkey, 0 if error else length)
            if error or not flags & FLAG_NO_ACK:
                conn.sendall(ACK.pack(MAGIC_ACK, status, op, 0, idx, seq, length))

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
    ) -> None:
        """Book one frame (num_bytes 0: refused); deliver completed writes in seq order."""
        done: list[_WriteState] = []
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
            state.refused |= num_bytes == 0
            while (head := peer.pending.get(peer.next_seq)) and head.frames == head.num_frames:
                del peer.pending[peer.next_seq]
                peer.next_seq += 1
                done.append(head)
        for state in done:
            if state.refused:
                self._registry.count_refused(peer.peer_id, "write")
            else:
                self._registry.count_write(state.num_bytes)
                keys = frozenset((state.rkey,))
                self._queue.put(Completion(state.imm, peer.peer_id, state.num_bytes, keys))
