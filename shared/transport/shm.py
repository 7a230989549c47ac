"""Same-host backend: the receiver's regions live in /dev/shm segments the writer maps and copies
into directly; immediates travel over a unix socket.

Receiver: ``allocate`` creates a segment; registering remote-accessible memory inside one publishes
``(rkey, addr, length, access, segment, offset)`` in a region table (itself a segment) that writers
map. Deregistration marks the slot retired, so later writes are refused by the writer's check.
Writer: validates every entry against the table, copies in a worker thread (torch ``copy_``
releases the GIL), then sends ``WRITE_DONE(imm, seq, bytes)``; the receiver turns it into a
Completion. Notifications leave in ``write()`` call order, so completions arrive in that order.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import secrets
import shutil
import socket
import struct
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch
from kvmesh.shared.config.stale_dirs import make_owned_dir
from kvmesh.shared.kv.descriptor import ShmBackend, TransportDescriptor
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.backend import HostMemoryBackend
from kvmesh.shared.transport.base import (
    Access,
    MemoryRegion,
    MemoryWindow,
    local_host_id,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import PeerUnreachableError, RefusalReason, TransportClosedError
from kvmesh.shared.transport.lane_auth import HelloRefused, LaneHello
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.server import SocketServer
from kvmesh.shared.transport.shm_segments import (
    SHM_DIR,
    SOCKET_NAME,
    ShmSegment,
    UntrustedDescriptorError,
    check_segment_name,
    check_socket_path,
    close_mapping,
    map_segment,
    segment_token,
    sweep_stale_segments,
)

if TYPE_CHECKING:
    from kvmesh.shared.transport.shm_endpoint import ShmEndpoint

log = logs.get_logger(__name__)

PAGE = mmap.PAGESIZE
TABLE_SLOTS = 8192
# One slot per remotely accessible region, and one per span of each open window. state: 0 free, 1 live, 2 retired.
TABLE_DTYPE = np.dtype(
    [
        ("rkey", "<u4"),
        ("state", "<u4"),
        ("addr", "<u8"),
        ("length", "<u8"),
        ("seg_offset", "<u8"),
        ("access", "<u4"),
        ("pad", "<u4"),
        ("segment", "S64"),
    ]
)
FREE, LIVE, RETIRED = 0, 1, 2

# Notifications writer -> receiver: op, reason, imm, rkey (the key a write used), seq, num_bytes.
# HELLO's payload: peer id.
NOTE = struct.Struct("<BBHIIQQ")
OP_HELLO, OP_WRITE_DONE, OP_READ_DONE, OP_REFUSED = 0, 1, 2, 3


class ShmHello:
    """The receiver's side of an shm writer's hello (a ``connection_tables.Handshake``):
    ``NOTE`` with ``OP_HELLO`` and the peer id's length, then the peer id. The socket's folder
    (0700, owner checked) keeps other users out, so the hello proves nothing more."""

    def __init__(self) -> None:
        self._n: int | None = None
        self._buf = bytearray()

    def challenge(self) -> bytes:
        return b""

    def need(self) -> int:
        return (NOTE.size if self._n is None else self._n) - len(self._buf)

    def feed(self, data: bytes) -> LaneHello | None:
        self._buf += data
        if self.need():
            return None
        if self._n is None:
            op, _, _, _, _, _, n = NOTE.unpack(self._buf)
            if op != OP_HELLO or not 0 < n <= 256:
                raise HelloRefused(f"bad shm hello (op {op}, peer id of {n} bytes)")
            self._n, self._buf = n, bytearray()
            return None
        return LaneHello(0, 1, 0, self._buf.decode(errors="replace"))


def _reason_name(code: int) -> str:
    try:
        return RefusalReason(code).name
    except ValueError:
        return f"code {code}"


class ShmTransport(HostMemoryBackend[ShmBackend]):
    """Shared-memory transport; use as ``async with ShmTransport(config) as t``."""

    name, part = "shm", ShmBackend

    def __init__(
        self,
        config: TransportConfig | None = None,
        *,
        registry: Registry | None = None,
        completions: CompletionQueue | None = None,
        strict: bool = True,
    ) -> None:
        super().__init__(config, registry, completions)
        self._strict = strict  # refuse remote registrations outside a segment (no tcp fallback)
        self._token = f"kvmesh-{os.getpid()}-{secrets.token_hex(4)}"
        self._segments: list[ShmSegment] = []
        self._window_slots: dict[int, list[int]] = {}
        self._unshared: set[int] = set()  # remote regions outside segments (strict=False only)
        self._table_seg: ShmSegment | None = None
        self._table: np.ndarray | None = None
        self._dir: str | None = None
        self._server: SocketServer | None = None
        self._lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------------

    @property
    def socket_path(self) -> str:
        assert self._dir is not None, "enter the transport first"
        return os.path.join(self._dir, SOCKET_NAME)

    async def start(self) -> None:
        if self._server is not None:
            return
        sweep_stale_segments()
        self._table_seg = ShmSegment(f"{self._token}-table", TABLE_SLOTS * TABLE_DTYPE.itemsize)
        self._table = np.frombuffer(self._table_seg.mm, dtype=TABLE_DTYPE)
        # a receiver killed before closing left its socket folder: those of dead pids go first
        self._dir = make_owned_dir("kvmesh-", self.config.shm_dir, only=frozenset({SOCKET_NAME}))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        self._registry.add_listener(self)
        self._server = SocketServer(
            listener, self._serve, "shm-notify", ShmHello, limits=self.config.server_limits()
        )
        self._server.start()

    async def _teardown(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        for seg in [*self._segments, *([self._table_seg] if self._table_seg else [])]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, seg.name))
        self._table = None
        if self._table_seg is not None:
            self._table_seg.tensor = None  # type: ignore[assignment]
            close_mapping(self._table_seg.mm)
        for seg in self._segments:
            seg.tensor = None  # type: ignore[assignment]
            close_mapping(seg.mm)
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._queue.close()

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor in a fresh /dev/shm segment (page-aligned, zeroed)."""
        if nbytes <= 0:
            raise ValueError(f"allocate needs a positive size, got {nbytes}")
        self._check_not_closed()
        size = -(-nbytes // PAGE) * PAGE
        seg = ShmSegment(f"{self._token}-{len(self._segments)}", size)
        self._segments.append(seg)
        return seg.tensor[:nbytes]

    def on_register(self, region: MemoryRegion) -> None:
        if not region.access & Access.REMOTE:
            return
        seg = self._segment_holding(region.addr, region.end)
        if seg is None:
            if self._strict:
                raise ValueError(
                    "shm can expose only memory from transport.allocate(); register a view of an "
                    "allocated tensor (e.g. KVPool built over it)"
                )
            self._unshared.add(region.rkey)
        # No row for the region itself: writers reach memory through windows' rows only.

    def on_deregister(self, region: MemoryRegion) -> None:
        self._unshared.discard(region.rkey)  # its windows' rows were retired before this

    def on_window_open(self, window: MemoryWindow) -> None:
        """One table row per span, under the window's key: writers check against those rows."""
        if window.region_rkey in self._unshared:
            return  # memory outside shm: tcp serves it (and checks the window itself)
        first, last = window.spans[0], window.spans[-1]
        seg = self._segment_holding(first[0], last[0] + last[1])
        assert seg is not None, "a window lies inside its region, and the region in a segment"
        slots = self._free_slots(len(window.spans))
        for slot, (addr, length) in zip(slots, window.spans, strict=True):
            self._publish_row(slot, window.rkey, addr, length, window.access, seg)
        self._window_slots[window.rkey] = slots

    def on_window_close(self, window: MemoryWindow) -> None:
        slots = self._window_slots.pop(window.rkey, ())
        if self._table is not None:
            for slot in slots:
                self._table["state"][slot] = RETIRED

    def _segment_holding(self, addr: int, end: int) -> ShmSegment | None:
        """The allocated segment that holds ``[addr, end)``, if any."""
        return next((s for s in self._segments if s.addr <= addr and end <= s.addr + s.size), None)

    def _free_slots(self, n: int) -> list[int]:
        table = self._table
        assert table is not None, "enter the transport before registering remote memory"
        free = np.flatnonzero(table["state"] != LIVE)
        if free.size < n:
            raise ValueError(
                f"shm region table full ({TABLE_SLOTS} rows: live regions and window spans)"
            )
        never_used = free[table["state"][free] == FREE]
        retired = free[table["state"][free] == RETIRED]
        return [int(x) for x in np.concatenate([never_used, retired])[:n]]

    def _publish_row(
        self, slot: int, rkey: int, addr: int, length: int, access: Access, seg: ShmSegment
    ) -> None:
        row = self._table[slot : slot + 1]
        row["state"] = FREE
        row["rkey"], row["addr"], row["length"] = rkey, addr, length
        row["seg_offset"], row["access"] = addr - seg.addr, int(access)
        row["segment"] = seg.name.encode()
        row["state"] = LIVE  # last: writers read state first

    @property
    def serves_all_regions(self) -> bool:
        """False when a remotely accessible region lies outside shm (only with strict=False)."""
        return not self._unshared

    def backend_info(self) -> ShmBackend:
        if self._table_seg is None:
            raise TransportClosedError("enter the transport before asking for its descriptor")
        return ShmBackend(socket=self.socket_path, table=self._table_seg.name)

    # -- receiver: notification channel ------------------------------------------------------------

    def _serve(self, conn: socket.socket, hello: LaneHello) -> None:
        """Serve one writer's notifications (its hello read by the server: ``ShmHello``)."""
        peer_id, refusals = hello.peer_id, 0
        buf = bytearray(NOTE.size)
        try:
            while conn.recv_into(buf, NOTE.size, socket.MSG_WAITALL) == NOTE.size:
                op, reason, _, imm, rkey, _, n = NOTE.unpack(buf)
                if op == OP_WRITE_DONE:
                    # The bytes were copied by the writer; its immediate counts only if the key it
                    # wrote with is a live window here (a forged or late immediate is refused).
                    if self._registry.is_live_key(rkey, Access.REMOTE_WRITE):
                        self._registry.count_write(n)
                        keys = frozenset((rkey,))
                        self._queue.put(Completion(imm, peer_id, n, keys))
                        continue
                    self._registry.count_refused(peer_id, f"write done with dead key {rkey}")
                elif op == OP_READ_DONE:
                    self._registry.count_read(n)
                    continue
                elif op == OP_REFUSED:
                    self._registry.count_refused(peer_id, _reason_name(reason))
                else:
                    return  # corrupt stream: drop this peer, keep serving others
                refusals += 1
                if refusals >= self.config.max_refusals:
                    log.info("shm writer disconnected: too many refusals", peer=peer_id)
                    return  # a writer that keeps naming dead keys is probing
        except OSError:
            return

    # -- writer ------------------------------------------------------------------------------------

    async def connect(self, descriptor: TransportDescriptor) -> ShmEndpoint:
        from kvmesh.shared.transport.shm_endpoint import ShmEndpoint

        self._check_not_closed()
        info = self.peer_part(descriptor)
        if descriptor.host_id != local_host_id():
            raise PeerUnreachableError(
                f"peer {descriptor.peer_id} is on host {descriptor.host_id}, not this one "
                f"({local_host_id()}); use tcp or rdma"
            )
        table = check_segment_name(info.table)
        if not table.endswith("-table"):
            raise UntrustedDescriptorError(f"shm table {table!r} is not a region table segment")
        socket_path = check_socket_path(info.socket)
        try:
            table_mm = map_segment(table)
        except OSError as exc:
            raise PeerUnreachableError(
                f"cannot map shm peer {descriptor.peer_id}'s table {table}: {exc}"
            ) from exc
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(socket_path), self.config.connect_timeout_s
            )
        except (OSError, TimeoutError) as exc:
            close_mapping(table_mm)
            raise PeerUnreachableError(
                f"cannot reach shm peer {descriptor.peer_id} at {info.socket}: {exc}"
            ) from exc
        hello = self._peer_id.encode()
        writer.write(NOTE.pack(OP_HELLO, 0, 0, 0, 0, 0, len(hello)) + hello)
        ep = ShmEndpoint(self, descriptor.peer_id, segment_token(table), table_mm, reader, writer)
        self._endpoints.add(ep)
        return ep
