"""Lease-scoped write authority: one memory window per reservation, over exactly its blocks.

The decode worker's pool is one registered region, but its key never leaves the process: each
reservation's writer gets the key of a window onto that reservation's blocks alone, which closes
when the reservation leaves the pending table (admitted, failed, aborted) or its lease expires. A
write into a block under no lease, into another lease's blocks, or after the lease ended is then
refused by the transport, counted and logged (docs/security.md). On rdma the NIC enforces it
with memory windows; on a NIC without them the window is the region itself
(``MemoryWindow.enforced`` is False).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.services.decode.pending import PendingTable
from kvmesh.shared.bus.messages.placement import DecodeRankTarget
from kvmesh.shared.transport.base import Access, MemoryRegion, MemoryWindow, Transport


class LeaseWindows:
    """Opens and closes the windows of one decode worker's pool (block ``b`` lies at
    ``region.addr + b * block_bytes``)."""

    def __init__(self, transport: Transport, region: MemoryRegion, block_bytes: int) -> None:
        self.transport = transport
        self.region = region
        self.block_bytes = block_bytes

    def open(self, block_ids: Sequence[int]) -> MemoryWindow:
        spans = [(self.region.addr + b * self.block_bytes, self.block_bytes) for b in block_ids]
        return self.transport.open_window(self.region, spans, Access.REMOTE_WRITE)

    def close(self, window: MemoryWindow) -> None:
        self.transport.close_window(window)

    def pending_table(self, quarantine_s: float) -> PendingTable:
        """The table that counts the leases' writes: into this one pool (a tensor-parallel
        worker's ``tp_leases.GroupWindows`` counts every rank's)."""
        return PendingTable(quarantine_s)

    def ranks(self, window: MemoryWindow | None) -> tuple[DecodeRankTarget, ...]:
        """The lease's windows on a tensor-parallel worker's other ranks (``ReserveReply.ranks``;
        none here: one pool, ``tp_leases.GroupWindows`` has them)."""
        return ()
