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
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvmesh.shared.transport.base import Access, MemoryRegion, MemoryWindow, Spans, merge_spans
from kvmesh.shared.transport.errors import (
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportError,
)
from kvmesh.shared.transport.rdma_mw_bind import NO_WINDOWS, BoundSpan, MwBinder, MwBinding

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma_memory import Registration
    from kvmesh.shared.transport.registry import Registry

log = logging.getLogger(__name__)

_MAX_RETIRED = 4096


@dataclass(slots=True)
class _Open:
    window: MemoryWindow
    reg: Registration
    in_registry: bool
    bindings: dict[int, MwBinding] = field(default_factory=dict)  # qpn -> its MWs


class WindowTable:
    """The open windows of one rdma transport and the MWs ``binder`` bound for them, per
    connection."""

    def __init__(self, binder: MwBinder, registry: Registry, max_refusals: int = 16) -> None:
        self.binder = binder
        self.registry = registry
        self._open: dict[int, _Open] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()
        # qpn -> the keys of the open windows bound on that connection. Replaced, never mutated:
        # the poller thread reads it to say whose authority an immediate came with.
        self._keys_by_qpn: dict[int, frozenset[int]] = {}
        self.max_refusals = max_refusals  # refused resolutions before a connection is ended
        self._refusals_by_qpn: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    @property
    def num_mws(self) -> int:
        """MWs allocated and not yet deallocated."""
        return self.binder.num_mws

    def keys_bound_on(self, qpn: int) -> frozenset[int]:
        """The keys of the open windows that the connection on QP ``qpn`` resolved: the only
        leases whose writer it can be (any thread)."""
        return self._keys_by_qpn.get(qpn, frozenset())

    # -- open / close ------------------------------------------------------------------------------

    def open(self, reg: Registration, spans: Spans, access: Access) -> MemoryWindow:
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
            self.binder.dealloc(binding.mws)
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
                self.binder.dealloc(binding.mws)

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
            binding = self.binder.bind(entry.reg, entry.window, qp)
            entry.bindings[qp.qp_num] = binding
            self._keys_by_qpn[qp.qp_num] = self.keys_bound_on(qp.qp_num) | {key}
        return entry.window.access, binding.spans

    def _forget_key(self, qpn: int, key: int) -> None:
        keys = self.keys_bound_on(qpn) - {key}
        if keys:
            self._keys_by_qpn[qpn] = keys
        else:
            self._keys_by_qpn.pop(qpn, None)


def _check(region: MemoryRegion, spans: Spans, access: Access) -> tuple[tuple[int, int], ...]:
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
