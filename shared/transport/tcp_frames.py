"""Frames of the tcp backend: an operation (``write`` or ``read``) in flight, the frames it is cut
into (at most ``tcp_slice_bytes`` each, referencing the writer's registered memory: no copy), and
the cutting itself."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvmesh.shared.transport.base import MemoryRegion, WriteEntry
from kvmesh.shared.transport.errors import LocalAccessError, TransportError
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.tcp import FRAME, MAGIC_FRAME, VERSION, tensor_buffer

MAX_IOV = 512  # payload pieces per frame


class Op:
    """One write() or read() in flight: done when every frame is ACKed or NAKed."""

    __slots__ = ("error", "future", "remaining")

    def __init__(self, future: asyncio.Future[None], num_frames: int) -> None:
        self.future = future
        self.remaining = num_frames
        self.error: TransportError | None = None


class Frame:
    __slots__ = (
        "addr", "count", "idx", "imm", "kind", "length", "op", "rkey", "seq", "span_addr",
        "span_len", "views",
    )  # fmt: skip

    def __init__(self, kind: int, rkey: int, addr: int) -> None:
        self.kind, self.rkey, self.addr = kind, rkey, addr
        self.length = 0
        self.views: list[memoryview] = []
        self.op: Op | None = None
        self.seq = self.idx = self.count = self.imm = 0
        self.span_addr = self.span_len = 0

    def header(self, flags: int) -> bytes:
        return FRAME.pack(
            MAGIC_FRAME, VERSION, self.kind, flags, self.rkey, self.imm, self.addr, self.length,
            self.seq, self.idx, self.count, self.span_addr, self.span_len,
        )  # fmt: skip


def _close_run(run: list[Frame]) -> None:
    if run:
        span = (run[0].addr, run[-1].addr + run[-1].length - run[0].addr)
        for frame in run:
            frame.span_addr, frame.span_len = span


def cut_frames(
    entries: Sequence[WriteEntry], kind: int, slice_bytes: int, registry: Registry
) -> list[Frame]:
    """Cut entries into frames of at most ``slice_bytes`` bytes. Entries contiguous in the remote
    region form one run; every frame carries its run's span, which the receiver checks whole,
    so a run is refused entirely or not at all (like one RDMA work request). Pieces of a frame
    contiguous in local memory too become one iovec."""
    if not entries:
        raise ValueError("an operation needs at least one entry")
    regions: dict[MemoryRegion, memoryview] = {}  # each local region checked once per call
    frames: list[Frame] = []
    run: list[Frame] = []
    tail: tuple[Frame, MemoryRegion, int, int] | None = None  # last piece: frame, region, span
    for e in entries:
        whole = regions.get(e.local)
        if whole is None:
            whole = tensor_buffer(registry.local_view(e.local, 0, e.local.length))
            if len(whole) != e.local.length:
                raise LocalAccessError(f"local region {e.local} does not match its registration")
            regions[e.local] = whole
        cur = run[-1] if run else None
        if cur is None or cur.rkey != e.rkey or cur.addr + cur.length != e.remote_addr:
            _close_run(run)
            run = []
        off = 0
        while off < e.length:
            cur = run[-1] if run else None
            if cur is None or cur.length >= slice_bytes or len(cur.views) >= MAX_IOV:
                cur = Frame(kind, e.rkey, e.remote_addr + off)
                run.append(cur)
                frames.append(cur)
            take = min(e.length - off, slice_bytes - cur.length)
            start = e.local_offset + off  # WriteEntry checked the bounds
            if tail and tail[0] is cur and tail[1] == e.local and tail[3] == start:
                cur.views[-1] = whole[tail[2] : start + take]  # locally contiguous: merge
                tail = (cur, e.local, tail[2], start + take)
            else:
                cur.views.append(whole[start : start + take])
                tail = (cur, e.local, start, start + take)
            cur.length += take
            off += take
    _close_run(run)
    return frames


__all__ = ["MAX_IOV", "Frame", "Op", "cut_frames"]
