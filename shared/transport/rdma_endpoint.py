"""One RC connection of the rdma backend: batched writes (WRITE_WITH_IMM last) and reads over its
queue pair, with send-queue slot accounting and failure -> typed error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared.transport.base import (
    Access,
    MemoryRegion,
    PeerGoneError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
    TransportError,
    WriteEntry,
    check_imm,
)
from shared.transport.rdma_qp import Span, build_segments

if TYPE_CHECKING:
    from shared.transport.rdma import QPEntry, RdmaTransport


class RdmaEndpoint:
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
    ) -> None:
        self._t = transport
        self._entry = entry
        self._peer_id = peer_id
        self._regions = {r.rkey: r for r in regions}  # what the peer advertised at connect
        self._iova = iova
        self._side_channel = side_channel
        self._free_wrs = transport.limits.send_depth
        self._slots = asyncio.Event()
        self._broken: TransportError | None = None
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def qp_num(self) -> int:
        return self._entry.info.qpn

    async def __aenter__(self) -> RdmaEndpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the side channel (the peer then destroys its QP), flush and destroy ours."""
        if self._closed:
            return
        self._closed = True
        if self._side_channel is not None:
            self._side_channel.close()
        self._t.retire_qp(self._entry)
        deadline = time.monotonic() + 1.0
        while self._t.has_pending(self) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # flush completions fail the operations in flight
        self._t.fail_pending(self, TransportClosedError(f"rdma endpoint to {self._peer_id} closed"))
        self._t.destroy_qp(self._entry)
        self._t.forget_endpoint(self)

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        """One batched one-sided write; the peer gets one completion carrying ``imm``."""
        check_imm(imm)
        # Shielded: a cancelled caller must not leave the batch half-posted (its imm never sent).
        await asyncio.shield(self._run(entries, Access.REMOTE_WRITE, imm))

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        """Pull each entry's remote span into its local span; no completion at the peer."""
        await asyncio.shield(self._run(entries, Access.REMOTE_READ, None))

    def _span(self, entry: WriteEntry, access: Access) -> Span:
        local_addr, lkey = self._t.memory.local_span(entry.local, entry.local_offset, entry.length)
        remote_addr = entry.remote_addr
        region = self._regions.get(entry.rkey)
        if region is not None:  # advertised: refuse here rather than break the QP
            if region.access & access != access:
                raise RemoteAccessError(
                    RefusalReason.ACCESS_DENIED, f"rkey={entry.rkey} grants {region.access!r}"
                )
            if remote_addr < region.addr or remote_addr + entry.length > region.end:
                raise RemoteAccessError(
                    RefusalReason.OUT_OF_BOUNDS,
                    f"rkey={entry.rkey} access [{remote_addr:#x}, {remote_addr + entry.length:#x})"
                    f" region [{region.addr:#x}, {region.end:#x})",
                )
        if entry.rkey in self._iova:
            addr, iova = self._iova[entry.rkey]
            remote_addr = remote_addr - addr + iova
        return Span(local_addr, lkey, remote_addr, entry.rkey, entry.length)

    async def _run(self, entries: Sequence[WriteEntry], access: Access, imm: int | None) -> None:
        self._check_usable()
        if not entries:
            raise ValueError("a write or read needs at least one entry")
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
                futures.append(self._t.track(seg.wr_id, self, seg.num_wrs))
                try:
                    self._entry.qp.post_send(seg.head)
                except self._t.verbs.PyverbsError as exc:
                    error = PeerGoneError(f"posting to peer {self._peer_id} failed: {exc}")
                    self._t.complete(seg.wr_id, error)
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
