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

from shared import logs
from shared.transport.base import (
    Access,
    Buffer,
    LocalAccessError,
    MemoryRegion,
    RefusalReason,
    RemoteAccessError,
    TransportStats,
)

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


class Registry:
    """rkey -> registered memory. ``refusal``/``remote_view`` is the one gate every incoming
    access passes; one Registry may be shared by several backends of a composite transport."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[RegistryListener] = []
        self._entries: dict[int, _Entry] = {}
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
            if rkey and rkey not in self._entries and rkey not in self._retired:
                return rkey

    def deregister(self, region: MemoryRegion) -> None:
        with self._lock:
            entry = self._entries.get(region.rkey)
            if entry is None or entry.region != region:
                raise KeyError(f"region rkey={region.rkey} is not registered here")
            del self._entries[region.rkey]
            self._retired[region.rkey] = None
            for listener in self._listeners:
                listener.on_deregister(region)
            while len(self._retired) > _MAX_RETIRED:
                self._retired.popitem(last=False)

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
        """Why an access of ``[addr, addr+length)`` to region ``rkey`` must be refused, or None."""
        with self._lock:
            entry = self._entries.get(rkey)
            retired = rkey in self._retired
        if entry is None:
            reason = RefusalReason.DEREGISTERED if retired else RefusalReason.UNKNOWN_RKEY
            return RemoteAccessError(reason, f"rkey={rkey}")
        region = entry.region
        if region.access & access != access:
            return RemoteAccessError(
                RefusalReason.ACCESS_DENIED,
                f"rkey={rkey} grants {region.access!r}, needs {Access(access)!r}",
            )
        if length <= 0:
            return RemoteAccessError(RefusalReason.BAD_LENGTH, f"length={length}")
        if addr < region.addr or addr + length > region.end:
            return RemoteAccessError(
                RefusalReason.OUT_OF_BOUNDS,
                f"rkey={rkey} access [{addr:#x}, {addr + length:#x}) region "
                f"[{region.addr:#x}, {region.end:#x})",
            )
        return None

    def remote_view(self, rkey: int, addr: int, length: int, access: Access) -> torch.Tensor:
        """The (length,) uint8 view a peer may access; raises RemoteAccessError (not counted)."""
        error = self.refusal(rkey, addr, length, access)
        if error is not None:
            raise error
        with self._lock:
            entry = self._entries.get(rkey)
        if entry is None:  # deregistered between the check and now
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
