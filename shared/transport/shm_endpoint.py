"""Writer side of the shm backend: checks each entry against the peer's region table, copies
into the peer's mapped segments in a worker thread, then notifies the receiver."""

from __future__ import annotations

import asyncio
import contextlib
import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from kvmesh.shared.config.mapped_memory import mapping_tensor
from kvmesh.shared.kv.imm import check_imm
from kvmesh.shared.transport.backend import EndpointBase
from kvmesh.shared.transport.base import Access, WriteEntry
from kvmesh.shared.transport.errors import (
    PeerGoneError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
)
from kvmesh.shared.transport.shm import (
    FREE,
    LIVE,
    NOTE,
    OP_READ_DONE,
    OP_REFUSED,
    OP_WRITE_DONE,
    TABLE_DTYPE,
)
from kvmesh.shared.transport.shm_segments import (
    UntrustedDescriptorError,
    check_segment_name,
    close_mapping,
    map_segment,
    segment_token,
)

if TYPE_CHECKING:
    from kvmesh.shared.transport.shm import ShmTransport


class ShmEndpoint(EndpointBase):
    """Writer side of one shm peer: mapped region table and segments, notification stream."""

    backend = "shm"

    def __init__(
        self,
        transport: ShmTransport,
        peer_id: str,
        token: str,
        table_mm: mmap.mmap,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        super().__init__(peer_id)
        self._transport = transport
        self._token = token  # the table's creator: its rows may name only that creator's segments
        self._table_mm = table_mm
        self._table = np.frombuffer(table_mm, dtype=TABLE_DTYPE)
        self._reader = reader
        self._writer = writer
        self._mappings: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._seq = 0
        self._tail: asyncio.Task[None] | None = None

    async def _teardown(self) -> None:
        self._transport.forget_endpoint(self)
        self._writer.close()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()
        self._table = None  # type: ignore[assignment]
        close_mapping(self._table_mm)
        for mm, _ in self._mappings.values():
            close_mapping(mm)
        self._mappings.clear()

    def _remote_view(self, rkey: int, addr: int, length: int, access: Access) -> torch.Tensor:
        """Check one entry against the peer's table (window rows only: a region's own key has
        none); the (length,) view of its mapped bytes. Refused as on tcp: ``REFUSED``, with
        what the table showed in the message."""
        table = self._table
        slots = np.flatnonzero((table["rkey"] == rkey) & (table["state"] != FREE))
        if slots.size == 0:
            raise _refused(RefusalReason.UNKNOWN_RKEY, f"rkey={rkey}")
        live = slots[table["state"][slots] == LIVE]
        if live.size == 0:
            raise _refused(RefusalReason.DEREGISTERED, f"rkey={rkey}")
        # A window has one row per span: the one that holds the access, if any.
        holds = [  # in Python ints: a corrupt row's addr + length may overflow 64 bits
            int(i)
            for i in live
            if int(table["addr"][i]) <= addr < int(table["addr"][i]) + int(table["length"][i])
        ]
        row = table[holds[0] if holds else int(live[0])]
        base, size = int(row["addr"]), int(row["length"])
        if int(row["access"]) & access != access:
            raise _refused(RefusalReason.ACCESS_DENIED, f"rkey={rkey}")
        if addr < base or addr + length > base + size:
            raise _refused(
                RefusalReason.OUT_OF_BOUNDS,
                f"rkey={rkey} access [{addr:#x}, {addr + length:#x}) region "
                f"[{base:#x}, {base + size:#x})",
            )
        name = row["segment"].decode(errors="replace")
        mapping = self._mappings.get(name)
        if mapping is None:
            if segment_token(check_segment_name(name)) != self._token or name.endswith("-table"):
                raise UntrustedDescriptorError(
                    f"peer {self._peer_id}'s region table names segment {name!r}: its table or "
                    f"a segment of another transport (expected {self._token}-<n>)"
                )
            try:
                mm = map_segment(name)
            except OSError as exc:
                raise PeerGoneError(f"peer {self._peer_id} segment {name} is gone: {exc}") from exc
            mapping = self._mappings[name] = (mm, mapping_tensor(mm))
        start = int(row["seg_offset"]) + addr - base
        if start + length > mapping[1].numel():  # a slice would be cut short: a silent no-op
            raise UntrustedDescriptorError(
                f"peer {self._peer_id}'s region table row for rkey={rkey} points past the end "
                f"of segment {name!r}"
            )
        return mapping[1][start : start + length]

    def _plan(
        self, entries: Sequence[WriteEntry], access: Access
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(local view, remote view) per entry; every entry is checked before anything is copied."""
        if self._closed:
            raise TransportClosedError(f"endpoint to {self._peer_id} is closed")
        if not entries:
            raise ValueError("a write needs at least one entry")
        registry = self._transport._registry
        pairs = []
        for e in entries:
            local = registry.local_view(e.local, e.local_offset, e.length)
            pairs.append((local, self._remote_view(e.rkey, e.remote_addr, e.length, access)))
        return pairs

    async def _notify(
        self, op: int, imm: int, num_bytes: int, reason: int = 0, rkey: int = 0
    ) -> None:
        try:
            self._writer.write(NOTE.pack(op, reason, 0, imm, rkey, self._seq, num_bytes))
            await asyncio.wait_for(self._writer.drain(), self._transport.config.op_timeout_s)
        except TimeoutError as exc:
            raise PeerGoneError(
                f"shm peer {self._peer_id} stopped reading notifications for "
                f"{self._transport.config.op_timeout_s} s (op_timeout_s)"
            ) from exc
        except (OSError, ConnectionError, RuntimeError) as exc:
            raise PeerGoneError(
                f"shm peer {self._peer_id} closed its notification socket: {exc}"
            ) from exc
        if self._reader.at_eof():
            raise PeerGoneError(f"shm peer {self._peer_id} went away")

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        check_imm(imm)
        try:
            pairs = self._plan(entries, Access.REMOTE_WRITE)
        except RemoteAccessError as exc:
            await self._notify(OP_REFUSED, imm, 0, int(exc.cause or exc.reason))
            raise
        prev = self._tail
        task = self._tail = asyncio.ensure_future(self._place(pairs, imm, entries[0].rkey, prev))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        # shielded: a write the caller gave up on still completes, so the order stays whole
        await asyncio.shield(task)

    async def _place(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        imm: int,
        rkey: int,
        prev: asyncio.Task[None] | None,
    ) -> None:
        await asyncio.to_thread(_copy_all, [(dst, src) for src, dst in pairs])
        if prev is not None:
            await asyncio.wait({prev})  # notifications leave in write() order
        self._seq += 1
        await self._notify(OP_WRITE_DONE, imm, sum(src.numel() for src, _ in pairs), rkey=rkey)

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        """Copy each entry's remote span (checked against the peer's table: a live key granting
        REMOTE_READ, inside its window's spans) into the local span. A refusal is reported to
        the owner, which counts it, as for writes."""
        try:
            pairs = self._plan(entries, Access.REMOTE_READ)
        except RemoteAccessError as exc:
            await self._notify(OP_REFUSED, 0, 0, int(exc.cause or exc.reason))
            raise
        await asyncio.to_thread(_copy_all, pairs)
        await self._notify(OP_READ_DONE, 0, sum(e.length for e in entries))


def _copy_all(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for each pair, merging runs contiguous on both sides. Runs in a thread."""
    i = 0
    while i < len(pairs):
        dst, src = pairs[i]
        d0, s0, n = dst.data_ptr(), src.data_ptr(), dst.numel()
        j = i + 1
        while j < len(pairs):
            nd, ns = pairs[j]
            if nd.data_ptr() != d0 + n or ns.data_ptr() != s0 + n:
                break
            if not (_same_storage(nd, dst) and _same_storage(ns, src)):
                break
            n += nd.numel()
            j += 1
        if j == i + 1:
            dst.copy_(src)
        else:
            _span(dst, d0, n).copy_(_span(src, s0, n))
        i = j


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _span(view: torch.Tensor, addr: int, n: int) -> torch.Tensor:
    base = view.untyped_storage()
    offset = addr - base.data_ptr()
    return torch.empty(0, dtype=torch.uint8).set_(base, offset, (n,))


def _refused(cause: RefusalReason, detail: str) -> RemoteAccessError:
    """A refusal by the peer's table, reported as every backend reports one (``REFUSED``)."""
    return RemoteAccessError(RefusalReason.REFUSED, f"{cause.name.lower()}: {detail}", cause)
