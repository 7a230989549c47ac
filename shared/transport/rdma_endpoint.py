"""One RC connection of the rdma backend: batched writes (WRITE_WITH_IMM last) and reads over its
queue pair, with send-queue slot accounting and failure -> typed error.

Where the peer binds memory windows, a key in a WriteEntry is a window's token: the endpoint
resolves it once over the connection's side channel into the window's spans and their MW rkeys
(rdma_windows.py), then writes each entry with the rkey of the span that holds it."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.shared.kv.imm import check_imm
from kvmesh.shared.transport.backend import EndpointBase
from kvmesh.shared.transport.base import Access, MemoryRegion, WriteEntry
from kvmesh.shared.transport.errors import (
    PeerGoneError,
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
    TransportError,
)
from kvmesh.shared.transport.rdma_mw_bind import NO_WINDOWS, BoundSpan
from kvmesh.shared.transport.rdma_qp import Span, build_segments
from kvmesh.shared.transport.rdma_side_channel import MAX_REPLY_FRAME, read_frame, write_frame

_MAX_CACHED_WINDOWS = 4096  # resolved windows remembered per endpoint (one per lease)

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma import RdmaTransport
    from kvmesh.shared.transport.rdma_connections import QPEntry


class RdmaEndpoint(EndpointBase):
    """A connection to one peer: ``write`` returns once the peer acknowledged every byte."""

    backend = "rdma"

    def __init__(
        self,
        transport: RdmaTransport,
        entry: QPEntry,
        peer_id: str,
        regions: Sequence[MemoryRegion],
        iova: dict[int, tuple[int, int]],
        side_channel: asyncio.StreamWriter | None,
        reader: asyncio.StreamReader | None = None,
        memory_windows: int = NO_WINDOWS,
    ) -> None:
        super().__init__(peer_id)
        self._t = transport
        self._entry = entry
        self._regions = {r.rkey: r for r in regions}  # what the peer advertised at connect
        self._iova = iova
        self._side_channel = side_channel
        self._reader = reader
        self._memory_windows = memory_windows
        self._resolved: OrderedDict[int, tuple[Access, tuple[BoundSpan, ...]]] = OrderedDict()
        self._resolving = asyncio.Lock()  # one request at a time on the side channel
        self._free_wrs = transport.limits.send_depth
        self._slots = asyncio.Event()
        self._broken: TransportError | None = None

    @property
    def qp_num(self) -> int:
        return self._entry.info.qpn

    async def _teardown(self) -> None:
        """Close the side channel (the peer then destroys its QP), flush and destroy ours."""
        if self._side_channel is not None:
            self._side_channel.close()
        self._t.qps.retire(self._entry)
        deadline = time.monotonic() + 1.0
        while self._t.poller.has_pending(self) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # flush completions fail the operations in flight
        self._t.poller.fail_pending(
            self, TransportClosedError(f"rdma endpoint to {self._peer_id} closed")
        )
        self._t.qps.destroy(self._entry)
        self._t.forget_endpoint(self)

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        """One batched one-sided write; the peer gets one completion carrying ``imm``."""
        check_imm(imm)
        # Shielded: a cancelled caller must not leave the batch half-posted (its imm never sent).
        await asyncio.shield(self._run(entries, Access.REMOTE_WRITE, imm))

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        """Pull each entry's remote span into its local span; no completion at the peer."""
        await asyncio.shield(self._run(entries, Access.REMOTE_READ, None))

    async def _resolve(self, key: int) -> None:
        """Learn window ``key``'s spans and MW rkeys from the peer (once per window)."""
        if key in self._resolved:
            self._resolved.move_to_end(key)
            return
        async with self._resolving:
            if key in self._resolved:
                return
            if self._side_channel is None or self._reader is None:
                raise PeerGoneError(f"no side channel to {self._peer_id} to resolve window keys")
            try:
                await write_frame(self._side_channel, {"resolve": key})
                reply = await asyncio.wait_for(
                    read_frame(self._reader, MAX_REPLY_FRAME), self._t.config.op_timeout_s
                )
            except (TimeoutError, OSError, asyncio.IncompleteReadError, ProtocolError) as exc:
                error = PeerGoneError(f"resolving a window key with {self._peer_id}: {exc!r}")
                self._broken = self._broken or error
                raise error from exc
        if "error" in reply:
            try:  # reason 0: the connection failed on the peer's side (a bind failed)
                reason = RefusalReason(int(reply.get("reason", 0)))
            except (TypeError, ValueError):
                error = PeerGoneError(f"peer {self._peer_id}: {reply['error']}; connect again")
                self._broken = self._broken or error
                raise error from None
            raise RemoteAccessError(reason, f"peer {self._peer_id}: {reply['error']}")
        try:
            if reply.get("window") != key:
                raise ProtocolError(f"asked for window {key}, got {reply.get('window')!r}")
            access = Access(int(reply["access"]))
            spans = tuple(BoundSpan.from_list(item) for item in reply["spans"])
        except (KeyError, TypeError, ValueError, ProtocolError) as exc:
            error = PeerGoneError(f"peer {self._peer_id} answered a window key badly: {exc}")
            self._broken = self._broken or error
            raise error from exc
        self._resolved[key] = (access, spans)
        while len(self._resolved) > _MAX_CACHED_WINDOWS:
            self._resolved.popitem(last=False)

    def _window_span(self, entry: WriteEntry, access: Access) -> tuple[int, int]:
        """``(NIC address, MW rkey)`` of an entry through a resolved window."""
        granted, spans = self._resolved[entry.rkey]
        if granted & access != access:
            raise RemoteAccessError(
                RefusalReason.REFUSED,
                f"window {entry.rkey} grants {granted!r}",
                RefusalReason.ACCESS_DENIED,
            )
        for span in spans:
            wire = span.wire_addr(entry.remote_addr, entry.length)
            if wire is not None:
                return wire, span.rkey
        raise RemoteAccessError(
            RefusalReason.REFUSED,
            f"window {entry.rkey} access [{entry.remote_addr:#x}, "
            f"{entry.remote_addr + entry.length:#x}) is outside its {len(spans)} span(s)",
            RefusalReason.OUT_OF_BOUNDS,
        )

    def _span(self, entry: WriteEntry, access: Access) -> Span:
        local_addr, lkey = self._t.memory.local_span(entry.local, entry.local_offset, entry.length)
        if self._memory_windows:
            remote_addr, rkey = self._window_span(entry, access)
            return Span(local_addr, lkey, remote_addr, rkey, entry.length)
        remote_addr = entry.remote_addr
        region = self._regions.get(entry.rkey)
        if region is not None:  # advertised: refuse here rather than break the QP
            if region.access & access != access:
                raise RemoteAccessError(
                    RefusalReason.REFUSED,
                    f"rkey={entry.rkey} grants {region.access!r}",
                    RefusalReason.ACCESS_DENIED,
                )
            if remote_addr < region.addr or remote_addr + entry.length > region.end:
                raise RemoteAccessError(
                    RefusalReason.REFUSED,
                    f"rkey={entry.rkey} access [{remote_addr:#x}, {remote_addr + entry.length:#x})"
                    f" region [{region.addr:#x}, {region.end:#x})",
                    RefusalReason.OUT_OF_BOUNDS,
                )
        if entry.rkey in self._iova:
            addr, iova = self._iova[entry.rkey]
            remote_addr = remote_addr - addr + iova
        return Span(local_addr, lkey, remote_addr, entry.rkey, entry.length)

    async def _run(self, entries: Sequence[WriteEntry], access: Access, imm: int | None) -> None:
        self._check_usable()
        if not entries:
            raise ValueError("a write or read needs at least one entry")
        if self._memory_windows:
            for key in dict.fromkeys(e.rkey for e in entries):
                await self._resolve(key)
            self._check_usable()
        spans = [self._span(e, access) for e in entries]
        segments = build_segments(
            self._t.verbs,
            spans,
            read=access == Access.REMOTE_READ,
            imm=imm,
            limits=self._t.limits,
            next_wr_id=self._t.next_wr_id,
        )
        futures: list[asyncio.Future[None]] = []
        try:
            for seg in segments:
                await self._acquire(seg.num_wrs)
                self._check_usable()
                futures.append(self._t.poller.track(seg.wr_id, self, seg.num_wrs))
                try:
                    self._entry.qp.post_send(seg.head)
                except self._t.verbs.PyverbsError as exc:
                    error = PeerGoneError(f"posting to peer {self._peer_id} failed: {exc}")
                    self._t.poller.complete(seg.wr_id, error)
                    break
        finally:  # segments already posted run to completion either way
            results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    def _check_usable(self) -> None:
        if self._closed:
            raise TransportClosedError(f"rdma endpoint to {self._peer_id} is closed")
        if self._broken is not None:
            raise PeerGoneError(
                f"the connection to {self._peer_id} failed earlier ({self._broken}); connect again"
            )

    async def _acquire(self, num_wrs: int) -> None:
        while self._free_wrs < num_wrs:
            self._slots.clear()
            await self._slots.wait()
        self._free_wrs -= num_wrs

    def on_segment_done(self, num_wrs: int, error: TransportError | None) -> None:
        """Called by the transport (event loop) when a segment's signaled WR completed."""
        self._free_wrs += num_wrs
        self._slots.set()
        # a failed WR moves an RC QP to the error state for good; later posts only flush
        if error is not None and self._broken is None:
            self._broken = error
