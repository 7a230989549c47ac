"""Verbs memory windows bound on a connection's QP (for rdma_windows.py's WindowTable, one per
span of a window): the MW type a NIC binds, the binds posted in batches and waited for on the
control CQ, the spans a writer uses them as, and deallocation (which invalidates an MW at once).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmesh.shared.transport.base import Access, MemoryWindow
from kvmesh.shared.transport.errors import ProtocolError, TransportError
from kvmesh.shared.transport.rdma_qp import status_name

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma_memory import Registration

log = logging.getLogger(__name__)

NO_WINDOWS = 0  # the NIC binds no memory windows: keys are the region's (unenforced_window)
BIND_TIMEOUT_S = 2.0


def choose_window_type(verbs: Any, device_attr: Any) -> int:
    """The MW type to bind (``IBV_MW_TYPE_2`` over ``IBV_MW_TYPE_1``) or NO_WINDOWS, from
    ``ibv_query_device``'s ``device_cap_flags``."""
    e = verbs.e
    flags = int(getattr(device_attr, "device_cap_flags", 0))
    if flags & (e.IBV_DEVICE_MEM_WINDOW_TYPE_2A | e.IBV_DEVICE_MEM_WINDOW_TYPE_2B):
        return int(e.IBV_MW_TYPE_2)
    if flags & e.IBV_DEVICE_MEM_WINDOW:
        return int(e.IBV_MW_TYPE_1)
    return NO_WINDOWS


def mw_access_flags(verbs: Any, access: Access) -> int:
    e = verbs.e
    flags = 0
    if access & Access.REMOTE_WRITE:
        flags |= e.IBV_ACCESS_REMOTE_WRITE
    if access & Access.REMOTE_READ:
        flags |= e.IBV_ACCESS_REMOTE_READ
    return flags


@dataclass(frozen=True, slots=True)
class BoundSpan:
    """One span of a window as a writer uses it: ``[addr, addr + length)`` in the receiver's
    address space, reached with NIC key ``rkey`` at NIC address ``nic_addr`` (== addr for host
    memory; the dma-buf offset for GPU memory)."""

    addr: int
    length: int
    rkey: int
    nic_addr: int

    def to_list(self) -> list[int]:
        return [self.addr, self.length, self.rkey, self.nic_addr]

    @classmethod
    def from_list(cls, item: Any) -> BoundSpan:
        try:
            addr, length, rkey, nic_addr = (int(x) for x in item)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed window span {item!r}: {exc}") from exc
        if length <= 0 or not 0 <= rkey <= 0xFFFFFFFF:
            raise ProtocolError(f"window span {item!r} has no length or a bad rkey")
        return cls(addr, length, rkey, nic_addr)

    def wire_addr(self, addr: int, length: int) -> int | None:
        """The NIC address of ``[addr, addr + length)`` if this span holds it, else None."""
        if self.addr <= addr and addr + length <= self.addr + self.length:
            return self.nic_addr + (addr - self.addr)
        return None


@dataclass(slots=True)
class MwBinding:
    """The MWs bound for one window on one connection, and its spans as a writer uses them."""

    mws: list[Any]
    spans: tuple[BoundSpan, ...]


class MwBinder:
    """Binds MWs of type ``mw_type`` and deallocates them, for one rdma transport.

    ``ctrl_cq`` is the send CQ of every accepted QP: nothing but binds is ever posted there,
    each batch is waited for before the next, so the event loop polls it inline.
    """

    def __init__(
        self,
        verbs: Any,
        pd: Any,
        mw_type: int,
        ctrl_cq: Any,
        next_wr_id: Callable[[], int],
        max_batch: int,
    ) -> None:
        assert mw_type != NO_WINDOWS
        self.verbs = verbs
        self.pd = pd
        self.mw_type = mw_type
        self.ctrl_cq = ctrl_cq
        self.next_wr_id = next_wr_id
        self.max_batch = max(1, max_batch)  # binds posted at once: fits the QP's send queue
        self.num_mws = 0  # allocated and not yet deallocated

    def bind(self, reg: Registration, window: MemoryWindow, qp: Any) -> MwBinding:
        """One MW per span of ``window`` (over ``reg``'s MR), bound on ``qp``; TransportError if
        a bind fails (the QP is then in the error state), every MW of it deallocated."""
        v = self.verbs
        flags = mw_access_flags(v, window.access)
        mws: list[Any] = []
        spans: list[BoundSpan] = []
        try:
            pending: list[tuple[Any, int, int, int]] = []  # (mw, addr, length, nic_addr)
            for addr, length in window.spans:
                mws.append(v.MW(self.pd, self.mw_type))
                self.num_mws += 1
                pending.append((mws[-1], addr, length, reg.iova + (addr - reg.region.addr)))
            step = self.max_batch
            for start in range(0, len(pending), step):
                spans.extend(self._bind_batch(qp, reg.mr, pending[start : start + step], flags))
        except v.PyverbsError as exc:
            self.dealloc(mws)
            raise TransportError(
                f"binding {len(window.spans)} memory window(s) failed: {exc}; the device "
                "may be out of memory windows (ibv_devinfo -v: max_mw)"
            ) from exc
        except TransportError:
            self.dealloc(mws)
            raise
        return MwBinding(mws, tuple(spans))

    def _bind_batch(
        self, qp: Any, mr: Any, batch: list[tuple[Any, int, int, int]], flags: int
    ) -> list[BoundSpan]:
        """Post one bind per MW, only the last signaled, and wait for it (RC send queues
        complete in order, so the last one's success means every bind took)."""
        v, e = self.verbs, self.verbs.e
        wr_id = self.next_wr_id()
        out = []
        if self.mw_type == e.IBV_MW_TYPE_1:  # the bind verb; libibverbs updates mw.rkey
            for i, (mw, addr, length, nic_addr) in enumerate(batch):
                signaled = e.IBV_SEND_SIGNALED if i == len(batch) - 1 else 0
                info = v.MWBindInfo(mr, nic_addr, length, flags)
                qp.bind_mw(mw, v.MWBind(info, signaled, wr_id))
                out.append(BoundSpan(addr, length, mw.rkey, nic_addr))
        else:  # type 2: IBV_WR_BIND_MW work requests; the new rkey is the WR's
            wrs, nxt = [], None
            for i in range(len(batch) - 1, -1, -1):
                mw, addr, length, nic_addr = batch[i]
                signaled = e.IBV_SEND_SIGNALED if i == len(batch) - 1 else 0
                wr = v.SendWR(
                    wr_id=wr_id, opcode=e.IBV_WR_BIND_MW, send_flags=signaled, next_wr=nxt
                )
                wr.set_bind_wr(mw, v.MWBindInfo(mr, nic_addr, length, flags))
                wrs.append(wr)
                nxt = wr
                out.append(BoundSpan(addr, length, wr.rkey, nic_addr))
            out.reverse()
            qp.post_send(nxt)
        self._wait(wr_id, e.IBV_WC_BIND_MW, "bind")
        return out

    def _wait(self, wr_id: int, opcode: int, what: str) -> None:
        """Poll the control CQ until ``wr_id`` completes; the first failure becomes the error."""
        e = self.verbs.e
        deadline = time.monotonic() + BIND_TIMEOUT_S
        error = None
        while True:
            _, wcs = self.ctrl_cq.poll(16)
            for wc in wcs:
                if wc.status != e.IBV_WC_SUCCESS and error is None:
                    error = TransportError(
                        f"memory window {what} failed: {status_name(self.verbs, wc.status)} "
                        f"(vendor error {wc.vendor_err:#x}); the connection it was bound on "
                        "is now in the error state"
                    )
                if wc.wr_id == wr_id:
                    if error is not None:
                        raise error
                    if wc.opcode != opcode:
                        raise TransportError(
                            f"memory window {what} completed with opcode {wc.opcode}, "
                            f"expected {opcode}"
                        )
                    return
            if time.monotonic() > deadline:
                raise error or TransportError(
                    f"memory window {what} did not complete within {BIND_TIMEOUT_S} s"
                )
            if not wcs:
                time.sleep(0)

    def dealloc(self, mws: list[Any]) -> None:
        """Deallocate ``mws`` (each is invalid at once) and empty the list."""
        for mw in mws:
            try:
                mw.close()
            except self.verbs.PyverbsError as exc:  # it stays bound: say so loudly
                log.error("deallocating a memory window failed (it may stay valid): %s", exc)
            self.num_mws -= 1
        mws.clear()
