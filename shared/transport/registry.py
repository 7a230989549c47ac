"""The local memory-region table: registration, rkey and bounds checks, receiver counters.

Thread-safe: backends check and count from their I/O threads while the event loop registers.
"""

from __future__ import annotations

import secrets
import threading
import warnings
from collections import OrderedDict
from typing import Protocol

import numpy as np
import torch
from kvmesh.shared.kv.region import Access, MemoryRegion
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.base import (
    Buffer,
    MemoryWindow,
    Spans,
    TransportStats,
    merge_spans,
)
from kvmesh.shared.transport.errors import LocalAccessError, RefusalReason, RemoteAccessError

_MAX_RETIRED = 4096  # deregistered rkeys remembered, to tell "deregistered" from "unknown"


def as_byte_tensor(memory: Buffer | np.ndarray) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``memory`` without copying (tensor, numpy array, buffer)."""
    if isinstance(memory, torch.Tensor):
        if memory.device.type != "cpu":
            raise TypeError(
                f"shm/tcp transports reach only host memory, got a {memory.device} tensor; "
                "use the rdma backend or stage through a CPU tensor"
            )
        if not memory.is_contiguous():
            raise ValueError("a registered tensor must be contiguous")
        return memory.view(torch.uint8).reshape(-1) if memory.dim() else memory.view(torch.uint8)
    if isinstance(memory, np.ndarray):
        if not memory.flags.c_contiguous:
            raise ValueError("a registered numpy array must be C-contiguous")
        return torch.from_numpy(memory.reshape(-1).view(np.uint8))
    view = memoryview(memory)
    if not view.contiguous:
        raise ValueError("a registered buffer must be contiguous")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        # read-only buffers (bytes) are fine as write sources; torch warns about them anyway
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(view.cast("B"), dtype=torch.uint8)


log = logs.get_logger(__name__)


class _Entry:
    __slots__ = ("region", "tensor")

    def __init__(self, region: MemoryRegion, tensor: torch.Tensor) -> None:
        self.region = region
        self.tensor = tensor  # (length,) uint8; keeps the memory alive while registered


class RegistryListener(Protocol):
    """Mirrors registrations elsewhere (the shm backend's cross-process region table)."""

    def on_register(self, region: MemoryRegion) -> None:
        """Called before the region goes live; raising refuses the registration."""
        ...

    def on_deregister(self, region: MemoryRegion) -> None: ...

    def on_window_open(self, window: MemoryWindow) -> None:
        """Called before the window goes live; raising refuses it."""
        ...

    def on_window_close(self, window: MemoryWindow) -> None: ...


class Registry:
    """rkey -> registered memory, and rkey -> window onto part of it. ``refusal``/``remote_view``
    is the one gate every incoming access passes, and it opens windows only; one Registry may be shared by several backends
    of a composite transport. Region keys count up from a random start; window keys are drawn at
    random, so that holding one key tells nothing about another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[RegistryListener] = []
        self._entries: dict[int, _Entry] = {}
        self._windows: dict[int, MemoryWindow] = {}
        self._retired: OrderedDict[int, None] = OrderedDict()
        self._next_rkey = secrets.randbits(31) | 1
        self._writes = self._bytes = self._refused = self._reads = self._read_bytes = 0

    # -- registration ------------------------------------------------------------------------------

    def add_listener(self, listener: RegistryListener) -> None:
        with self._lock:
            self._listeners.append(listener)
            live = [e.region for e in self._entries.values()]
        for region in live:
            listener.on_register(region)

    def register(
        self, memory: Buffer | np.ndarray, access: Access = Access.LOCAL, *, rkey: int | None = None
    ) -> MemoryRegion:
        """Register ``memory``; ``rkey`` lets a backend with hardware keys (rdma) choose it."""
        tensor = as_byte_tensor(memory)
        if tensor.numel() == 0:
            raise ValueError("cannot register an empty buffer")
        with self._lock:
            if rkey is None:
                rkey = self._fresh_rkey()
            elif rkey in self._entries:
                raise ValueError(f"rkey {rkey} is already registered")
            region = MemoryRegion(
                addr=tensor.data_ptr(), length=tensor.numel(), rkey=rkey, access=Access(access)
            )
            for listener in self._listeners:
                listener.on_register(region)
            self._retired.pop(rkey, None)
            self._entries[rkey] = _Entry(region, tensor)
        return region

    def _fresh_rkey(self) -> int:
        while True:
            rkey = self._next_rkey
            self._next_rkey = (self._next_rkey + 1) & 0xFFFFFFFF
            if rkey and not self._taken(rkey):
                return rkey

    def _taken(self, rkey: int) -> bool:
        return rkey in self._entries or rkey in self._windows or rkey in self._retired

    # -- windows -----------------------------------------------------------------------------------

    def open_window(
        self, region: MemoryRegion, spans: Spans, access: Access = Access.REMOTE_WRITE
    ) -> MemoryWindow:
        """A window with a fresh random key onto ``spans`` of the registered ``region``."""
        merged = merge_spans(spans)
        if not merged:
            raise ValueError("a window needs at least one span")
        with self._lock:
            entry = self._entries.get(region.rkey)
            if entry is None or entry.region != region:
                raise KeyError(f"region rkey={region.rkey} is not registered here")
            if Access(access) & region.access != access or not access:
                raise ValueError(
                    f"region rkey={region.rkey} grants {region.access!r}, not {access!r}"
                )
            for addr, length in merged:
                if addr < region.addr or addr + length > region.end:
                    raise ValueError(
                        f"window span [{addr:#x}, +{length}) is outside region "
                        f"[{region.addr:#x}, {region.end:#x})"
                    )
            rkey = 0
            while not rkey or self._taken(rkey):
                rkey = secrets.randbits(32)
            window = MemoryWindow(rkey, region.rkey, merged, Access(access))
            for listener in self._listeners:
                listener.on_window_open(window)
            self._windows[rkey] = window
        return window

    def close_window(self, window: MemoryWindow) -> None:
        with self._lock:
            self._close_window(window)

    def _close_window(self, window: MemoryWindow) -> None:
        if self._windows.get(window.rkey) != window:
            return  # closed already (or with its region)
        del self._windows[window.rkey]
        self._retire(window.rkey)
        for listener in self._listeners:
            listener.on_window_close(window)

    def _retire(self, rkey: int) -> None:
        self._retired[rkey] = None
        while len(self._retired) > _MAX_RETIRED:
            self._retired.popitem(last=False)

    @property
    def num_windows(self) -> int:
        return len(self._windows)

    def is_live_key(self, rkey: int, access: Access) -> bool:
        """Whether ``rkey`` names a live window granting ``access`` (a region's own key opens
        nothing from the network)."""
        with self._lock:
            window = self._windows.get(rkey)
        return window is not None and window.access & access == access

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._entries.get(region.rkey)
            if entry is None or entry.region != region:
                raise KeyError(f"region rkey={region.rkey} is not registered here")
            for window in [w for w in self._windows.values() if w.region_rkey == region.rkey]:
                self._close_window(window)
            del self._entries[region.rkey]
            self._retire(region.rkey)
            for listener in self._listeners:
                listener.on_deregister(region)

    def regions(self, access: Access = Access.LOCAL) -> list[MemoryRegion]:
        """Live regions granting at least ``access``."""
        with self._lock:
            return [e.region for e in self._entries.values() if e.region.access & access == access]

    def get(self, rkey: int) -> MemoryRegion | None:
        with self._lock:
            entry = self._entries.get(rkey)
            return entry.region if entry else None

    @property
    def num_regions(self) -> int:
        return len(self._entries)

    # -- checks ------------------------------------------------------------------------------------

    def refusal(
        self, rkey: int, addr: int, length: int, access: Access
    ) -> RemoteAccessError | None:
        """Why a peer's access of ``[addr, addr+length)`` with key ``rkey`` must be refused, or
        None. Only a live window's key opens anything: a region's own key never leaves this
        process and is refused like an unknown one, so nothing addressable from the network
        reaches memory outside a live window (the reason is for the log; peers are told only
        that the access was refused)."""
        with self._lock:
            window = self._windows.get(rkey)
            entry = self._entries.get(window.region_rkey) if window else None
            is_region = rkey in self._entries
            retired = rkey in self._retired
        if window is None or entry is None:
            if is_region:
                return RemoteAccessError(
                    RefusalReason.UNKNOWN_RKEY,
                    f"rkey={rkey} is a region's own key; peers reach memory only through windows",
                )
            reason = RefusalReason.DEREGISTERED if retired else RefusalReason.UNKNOWN_RKEY
            return RemoteAccessError(reason, f"rkey={rkey}")
        if window.access & access != access:
            return RemoteAccessError(
                RefusalReason.ACCESS_DENIED,
                f"window rkey={rkey} grants {window.access!r}, needs {Access(access)!r}",
            )
        if length <= 0:
            return RemoteAccessError(RefusalReason.BAD_LENGTH, f"length={length}")
        if not window.covers(addr, length):
            return RemoteAccessError(
                RefusalReason.OUT_OF_BOUNDS,
                f"window rkey={rkey} access [{addr:#x}, {addr + length:#x}) is outside the "
                f"window's {len(window.spans)} span(s)",
            )
        return None

    def remote_view(self, rkey: int, addr: int, length: int, access: Access) -> torch.Tensor:
        """The (length,) uint8 view a peer may access; raises RemoteAccessError (not counted)."""
        error = self.refusal(rkey, addr, length, access)
        if error is not None:
            raise error
        with self._lock:
            window = self._windows.get(rkey)
            entry = self._entries.get(window.region_rkey) if window else None
        if entry is None:  # closed between the check and now
            raise RemoteAccessError(RefusalReason.DEREGISTERED, f"rkey={rkey}")
        start = addr - entry.region.addr
        return entry.tensor[start : start + length]

    def local_view(self, region: MemoryRegion, offset: int, length: int) -> torch.Tensor:
        """The (length,) uint8 view of a local span of ``region``; raises LocalAccessError."""
        with self._lock:
            entry = self._entries.get(region.rkey)
        if entry is None or entry.region.addr != region.addr:
            raise LocalAccessError(
                f"local region rkey={region.rkey} is not registered with this transport; "
                "register it with transport.register() first"
            )
        if offset < 0 or length <= 0 or offset + length > region.length:
            raise LocalAccessError(
                f"local span [{offset}, {offset + length}) outside region of {region.length} bytes"
            )
        return entry.tensor[offset : offset + length]

    # -- counters ----------------------------------------------------------------------------------

    def count_write(self, num_bytes: int) -> None:
        with self._lock:
            self._writes += 1
            self._bytes += num_bytes

    def count_read(self, num_bytes: int, *, ops: int = 1) -> None:
        with self._lock:
            self._reads += ops
            self._read_bytes += num_bytes

    def count_refused(self, peer_id: str = "", reason: str = "") -> None:
        """A peer's write or read was refused; counted, and logged (1st, 10th, 100th, then every
        1,000th) so that probing shows in the logs without flooding them."""
        with self._lock:
            self._refused += 1
            n = self._refused
        if logs.is_sampled(n):
            log.warning("remote access refused", peer=peer_id, reason=reason, refused_total=n)

    def stats(self) -> TransportStats:
        with self._lock:
            return TransportStats(
                writes=self._writes,
                bytes=self._bytes,
                refused=self._refused,
                reads=self._reads,
                read_bytes=self._read_bytes,
            )

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._windows.clear()
