"""Cross-host backend: framed one-sided writes over several TCP lanes per endpoint.

On one host, lanes may go over a unix socket instead, the peer's uid checked
(``unix_lanes.py``). This module holds the wire format and the transport; the receiving side
is ``tcp_receiver.py``, the writer's ``tcp_endpoint.py`` / ``tcp_lane.py`` / ``tcp_frames.py``. Each lane proves it
belongs to the mesh first (``lane_auth.py``). Every frame carries a fixed header (magic,
version, op, rkey, imm, remote address, length, write sequence number, frame index / count).
The receiver checks the header against its registry *before* reading the payload, then
``recv_into``s the payload straight into the registered memory and ACKs it unless the writer
flagged it ``FLAG_NO_ACK`` (ACKs are cumulative per lane); a refused frame is drained into a
scratch buffer and NAKed ``REFUSED``; a corrupt, oversized, truncated or stalled frame closes
the endpoint. A write is cut into frames of at most ``tcp_slice_bytes`` (contiguous
remote runs are coalesced, scattered local pieces go out with one ``sendmsg``) spread over the
lanes; its Completion is delivered when all its frames are placed, in per-endpoint write order.
Each lane has at most ``tcp_window * tcp_slice_bytes`` bytes in flight.

Blocking sockets in threads: ``sendmsg`` / ``recv_into`` release the GIL, so lanes run in parallel
and the event loop only books ACKs.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import torch
from kvmesh.shared.config.advertise import default_route_address
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import lane_auth, unix_lanes
from kvmesh.shared.transport.backend import HostMemoryBackend
from kvmesh.shared.transport.completions import CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    ProtocolError,
    TransportClosedError,
)
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.server import SocketServer
from kvmesh.shared.transport.source_budget import SourceGuard

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
    if sock.family != socket.AF_UNIX:  # a same-host lane (unix_lanes) has no Nagle to turn off
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """SO_RCVTIMEO and SO_SNDTIMEO on a blocking socket: a recv or send that waits this long
    returns short or raises BlockingIOError, and the caller decides (the fast path stays one
    blocking MSG_WAITALL call)."""
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class TcpTransport(HostMemoryBackend[TcpBackend]):
    """TCP transport; use as ``async with TcpTransport(config) as t``."""

    name, part = "tcp", TcpBackend

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        registry: Registry | None = None,
        completions: CompletionQueue | None = None,
    ) -> None:
        super().__init__(config, registry, completions)
        self._server: SocketServer | None = None
        self._port = 0
        self._unix_path: str | None = None  # the same-host lane socket (unix_lanes), if any
        self._memory: list[mmap.mmap] = []
        # Lanes prove they know it (lane_auth); it travels only in this transport's descriptor.
        self._secret = lane_auth.new_secret()
        # per-source budgets, shared by the handshake thread and the lanes' refused accesses
        self._guard = SourceGuard(self.config.source_limits())
        from kvmesh.shared.transport.tcp_receiver import TcpReceiver

        self._receiver = TcpReceiver(self.config, self._registry, self._queue, self._guard)

    @property
    def port(self) -> int:
        return self._port

    @property
    def num_dropped(self) -> int:
        """Lanes the receiver dropped (idle, stalled, corrupt, too many refusals)."""
        return self._receiver.num_dropped

    @property
    def _peers(self) -> dict[tuple[str, int], Any]:
        """The receiver's writer endpoints (tests check none is left behind)."""
        return self._receiver.peers

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
            self._receiver.serve_lane,
            "tcp-lane",
            lambda: lane_auth.HelloReader(secret),
            on_admit=tune,
            accept_reply=lane_auth.ACCEPT,
            limits=self.config.server_limits(),
            guard=self._guard,
        )
        if self.config.tcp_unix_lanes:
            try:
                self._unix_path, unix_listener = unix_lanes.listen(self.config.shm_dir)
            except OSError as exc:  # optional: same-host writers dial TCP then
                log.warning("no same-host lane socket; tcp only", error=str(exc))
            else:
                self._server.add_listener(unix_listener, unix_lanes.refuse_other_users)
        self._server.start()

    @property
    def unix_path(self) -> str | None:
        """The same-host lane socket writers on this host dial (None: TCP only)."""
        return self._unix_path

    async def _teardown(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        if self._unix_path is not None:
            shutil.rmtree(os.path.dirname(self._unix_path), ignore_errors=True)
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

    def backend_info(self) -> TcpBackend:
        if self._server is None:
            raise TransportClosedError("enter the transport before asking for its descriptor")
        host = self.config.tcp_advertise_host or self.config.tcp_host
        if host in ("0.0.0.0", "::"):  # every interface: advertise the default route's
            host = default_route_address()
        return TcpBackend(
            host=host,
            port=self._port,
            secret=self._secret.hex(),
            lanes=self.config.tcp_lanes,
            unix=self._unix_path,
        )

    async def connect(self, descriptor: TransportDescriptor) -> TcpEndpoint:
        from kvmesh.shared.transport.tcp_endpoint import TcpEndpoint

        self._check_not_closed()
        ep = await TcpEndpoint.open(self, descriptor)
        self._endpoints.add(ep)
        return ep
