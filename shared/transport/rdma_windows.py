"""Lease-scoped write authority on rdma: verbs memory windows bound per connection.

A window's key (``MemoryWindow.rkey``) is a random 32-bit token, as on shm and tcp; it is not a
NIC key. A writer's endpoint resolves it once over its connection's side channel; the receiver
then allocates one memory window (MW) per span of the window, binds each to exactly its span of
the region's MR with the window's access, on the queue pair of *that* connection, waits for the
binds to complete (IBV_WC_BIND_MW) and answers with the MWs' rkeys. Every write then carries an
MW rkey and the NIC checks it: outside the span, after the window closed, or with the region's
own key (the MR grants no remote access, only MW_BIND) it fails with a remote access error.

Why bind at resolution, not at ``open_window``: a type-2 MW is usable only through the QP it was
bound on, and a prefill job is pulled by whichever worker is free, so the writer's connection is
not known when the decode worker reserves blocks; at resolution it is. Type 1 (PD-wide) is used
only where the NIC has no type 2; it is bound the same way (``ibv_bind_mw`` on that QP).

Why one MW per span, behind a token: a lease's blocks are rarely contiguous and the job carries
one key; one MW per merged span scopes every write to the lease's blocks alone, and the token
keeps one key per lease for the services. Why close by deallocating: ``ibv_dealloc_mw``
invalidates a bound MW at once and synchronously (close_window runs on expiry paths, and the
QP it was bound on may be in the error state or gone), and a fresh MW per binding needs no
tracking of the 8-bit rkey tag (libibverbs does not update a type-2 MW's rkey after a bind).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.shared.transport.base import Access, MemoryRegion, MemoryWindow, merge_spans
from kvmesh.shared.transport.errors import (
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportError,
)
from kvmesh.shared.transport.rdma_qp import status_name

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma_memory import Registration
    from kvmesh.shared.transport.registry import Registry

log = logging.getLogger(__name__)

NO_WINDOWS = 0  # the NIC binds no memory windows: keys are the region's (unenforced_window)
BIND_TIMEOUT_S = 2.0
_MAX_RETIRED = 4096


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
class _Binding:
    mws: list[Any]
    spans: tuple[BoundSpan, ...]


@dataclass(slots=True)
class _Open:
    window: MemoryWindow
    reg: Registration
    in_registry: bool
    bindings: dict[int, _Binding] = field(default_factory=dict)  # qpn -> its MWs


class WindowTable:
    """The open windows of one rdma transport and the MWs bound for them, per connection.

    ``ctrl_cq`` is the send CQ of every accepted QP: nothing but binds is ever posted there,
    each batch is waited for before the next, so the event loop polls it inline.
    """

    def __init__(
        self,
        verbs: Any,
        pd: Any,
        mw_type: int,
        ctrl_cq: Any,
        registry: Registry,
        next_wr_id: Callable[[], int],
        max_batch: int,
        max_refusals: int = 16,
    ) -> None:
        assert mw_type != NO_WINDOWS
        self.verbs = verbs
        self.pd = pd
        self.mw_type = mw_type
        self.ctrl_cq = ctrl_cq
        self.registry = registry
        self.next_wr_id = next_wr_id
        self.max_batch = max(1, max_batch)  # binds posted at once: fits the QP's send queue
        self._open: dict[int, _Open] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()
        # qpn -> the keys of the open windows bound on that connection. Replaced, never mutated:
        # the poller thread reads it to say whose authority an immediate came with.
        self._keys_by_qpn: dict[int, frozenset[int]] = {}
        self.num_mws = 0  # allocated and not yet deallocated
        self.max_refusals = max_refusals  # refused resolutions before a connection is ended
        self._refusals_by_qpn: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def keys_bound_on(self, qpn: int) -> frozenset[int]:
        """The keys of the open windows that the connection on QP ``qpn`` resolved: the only
        leases whose writer it can be (any thread)."""
        return self._keys_by_qpn.get(qpn, frozenset())

    # -- open / close ------------------------------------------------------------------------------

    def open(
        self, reg: Registration, spans: Sequence[tuple[int, int]], access: Access
    ) -> MemoryWindow:
        """A window with a fresh random key; nothing is bound until a writer resolves it."""
        region = reg.region
        stored = self.registry.get(region.rkey)  # the same region, without the lkey
        if stored is not None and (stored.addr, stored.length) == (region.addr, region.length):
            # host memory: tcp/shm peers of an auto transport honour the window too
            window = self.registry.open_window(stored, spans, access)
            entry = _Open(window, reg, in_registry=True)
        else:  # GPU memory lives only here
            window = MemoryWindow(
                self._fresh_key(), region.rkey, _check(region, spans, access), Access(access)
            )
            entry = _Open(window, reg, in_registry=False)
        self._open[window.rkey] = entry
        return window

    def _fresh_key(self) -> int:
        key = 0
        while not key or key in self._open or key in self._retired or self.registry.get(key):
            key = secrets.randbits(32)
        return key

    def close(self, window: MemoryWindow) -> None:
        """Invalidate every MW bound for ``window`` (deallocation); a closed window is a no-op."""
        entry = self._open.get(window.rkey)
        if entry is None or entry.window != window:
            return
        del self._open[window.rkey]
        self._retired[window.rkey] = None
        while len(self._retired) > _MAX_RETIRED:
            self._retired.popitem(last=False)
        for qpn, binding in entry.bindings.items():
            self._dealloc(binding.mws)
            self._forget_key(qpn, window.rkey)
        if entry.in_registry:
            self.registry.close_window(window)

    def close_region(self, region: MemoryRegion) -> None:
        """Close the windows over ``region`` (before its MR is deregistered: an MR with bound
        MWs cannot be)."""
        for entry in [e for e in self._open.values() if e.window.region_rkey == region.rkey]:
            self.close(entry.window)

    def close_all(self) -> None:
        for entry in list(self._open.values()):
            self.close(entry.window)

    def drop_connection(self, qpn: int) -> None:
        """The connection on QP ``qpn`` ended: deallocate the MWs bound on it."""
        self._keys_by_qpn.pop(qpn, None)
        self._refusals_by_qpn.pop(qpn, None)
        for entry in self._open.values():
            binding = entry.bindings.pop(qpn, None)
            if binding is not None:
                self._dealloc(binding.mws)

    # -- resolution --------------------------------------------------------------------------------

    def answer(self, request: dict[str, Any], qp: Any, peer_id: str) -> tuple[dict[str, Any], bool]:
        """The reply to a writer's ``{"resolve": key}`` on the connection of ``qp``, and whether
        the connection goes on. A refused key is counted and answered ``REFUSED`` whatever the
        reason (no oracle: the reason is logged only), and the connection kept, as tcp keeps
        it, until it has had ``max_refusals``; a failed bind leaves the QP in the error state,
        so the connection ends."""
        key = _requested_key(request)
        try:
            access, spans = self.resolve(key, qp)
        except RemoteAccessError as exc:
            self.registry.count_refused(peer_id, str(exc))
            refusals = self._refusals_by_qpn.get(qp.qp_num, 0) + 1
            self._refusals_by_qpn[qp.qp_num] = refusals
            reply = {"error": "window key refused", "reason": int(RefusalReason.REFUSED)}
            return reply, refusals < self.max_refusals
        except TransportError as exc:
            log.error("rdma window for %s: %s", peer_id, exc)
            return {"error": str(exc), "reason": 0}, False
        reply = {"window": key, "access": int(access), "spans": [s.to_list() for s in spans]}
        return reply, True

    def refusal(self, key: int) -> RemoteAccessError:
        """Why ``key`` names no open window."""
        if key in self._retired:
            return RemoteAccessError(RefusalReason.DEREGISTERED, f"window key {key} was closed")
        region = self.registry.get(key)
        if region is not None or any(e.reg.region.rkey == key for e in self._open.values()):
            return RemoteAccessError(
                RefusalReason.ACCESS_DENIED,
                f"key {key} is a region's own: on rdma a region is reachable only through a "
                "memory window (open_window)",
            )
        return RemoteAccessError(RefusalReason.UNKNOWN_RKEY, f"no window with key {key}")

    def resolve(self, key: int, qp: Any) -> tuple[Access, tuple[BoundSpan, ...]]:
        """The access and spans of window ``key``, with MWs bound for the connection on ``qp``
        (the first time it asks). Raises RemoteAccessError for a key that names no open window
        and TransportError when a bind fails (the QP is then in the error state)."""
        entry = self._open.get(key)
        if entry is None:
            raise self.refusal(key)
        binding = entry.bindings.get(qp.qp_num)
        if binding is None:
            binding = self._bind(entry, qp)
            entry.bindings[qp.qp_num] = binding
            self._keys_by_qpn[qp.qp_num] = self.keys_bound_on(qp.qp_num) | {key}
        return entry.window.access, binding.spans

    def _forget_key(self, qpn: int, key: int) -> None:
        keys = self.keys_bound_on(qpn) - {key}
        if keys:
            self._keys_by_qpn[qpn] = keys
        else:
            self._keys_by_qpn.pop(qpn, None)

    def _bind(self, entry: _Open, qp: Any) -> _Binding:
        v = self.verbs
        reg, window = entry.reg, entry.window
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
            self._dealloc(mws)
            raise TransportError(
                f"binding {len(window.spans)} memory window(s) failed: {exc}; the device "
                "may be out of memory windows (ibv_devinfo -v: max_mw)"
            ) from exc
        except TransportError:
            self._dealloc(mws)
            raise
        return _Binding(mws, tuple(spans))

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

    def _dealloc(self, mws: list[Any]) -> None:
        for mw in mws:
            try:
                mw.close()
            except self.verbs.PyverbsError as exc:  # it stays bound: say so loudly
                log.error("deallocating a memory window failed (it may stay valid): %s", exc)
            self.num_mws -= 1
        mws.clear()


def _check(
    region: MemoryRegion, spans: Sequence[tuple[int, int]], access: Access
) -> tuple[tuple[int, int], ...]:
    """Registry.open_window's checks, for regions outside the registry (GPU memory)."""
    merged = merge_spans(spans)
    if not merged:
        raise ValueError("a window needs at least one span")
    if Access(access) & region.access != access or not access:
        raise ValueError(f"region rkey={region.rkey} grants {region.access!r}, not {access!r}")
    for addr, length in merged:
        if addr < region.addr or addr + length > region.end:
            raise ValueError(
                f"window span [{addr:#x}, +{length}) is outside region "
                f"[{region.addr:#x}, {region.end:#x})"
            )
    return merged


def _requested_key(request: dict[str, Any]) -> int:
    key = request.get("resolve")
    if type(key) is not int or not 0 <= key <= 0xFFFFFFFF:
        raise ProtocolError(f"expected {{'resolve': <32-bit window key>}}, got {request!r}")
    return key


def no_windows_reply(request: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The answer of a transport whose NIC binds no memory windows."""
    _requested_key(request)
    error = "this peer binds no memory windows; write with its region keys"
    return {"error": error, "reason": int(RefusalReason.REFUSED)}, True


def log_window_support(device: str, mw_type: int) -> None:
    """Once per transport, at start-up: what bounds a peer's writes on this NIC."""
    if mw_type == NO_WINDOWS:
        log.warning(
            "RDMA device %s binds no memory windows here: rdma writes are scoped to the "
            "registered region, not to a lease, and region keys are advertised "
            "(docs/security.md)",
            device,
        )
    else:
        log.info("RDMA device %s: a type-%d memory window per lease span", device, mw_type)
