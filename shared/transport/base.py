"""The KV data plane API: verbs-like one-sided writes with immediate data.

Every backend (``shm``, ``tcp``, ``rdma``) keeps RDMA semantics so that RDMA is a thin shim:

* ``register(memory, access) -> MemoryRegion(addr, length, rkey)``: local memory the backend may read
  (source of writes) or expose to peers (``Access.REMOTE_WRITE`` / ``REMOTE_READ``).
* ``descriptor() -> TransportDescriptor`` (``kvmesh.shared.kv.descriptor``): typed, small;
  travels over NATS to peers.
* ``await connect(descriptor) -> Endpoint``; ``await endpoint.write(entries, imm)`` returns once the
  bytes are *placed* in the remote memory; the receiver then gets exactly one ``Completion`` per
  write, in write order per endpoint, from ``transport.completions()``.
* Addresses in ``WriteEntry.remote_addr`` are in the *receiver's* address space (as in RDMA);
  ``MemoryRegion.addr`` is the registering process's address of the first byte.
* A write that breaks the registration (unknown or deregistered rkey, bounds, access) is refused:
  ``RemoteAccessError`` on the writer, ``stats().refused`` on the receiver, no byte written outside
  the target region.

This module holds the API's vocabulary (windows, write entries, stats) and its Protocols; the
registration (``Access``, ``MemoryRegion``) and the descriptor live in the kv plane below
(``kv/region.py``, ``kv/descriptor.py``) because they travel on the wire; errors are in
errors.py, completions in completions.py, options in config.py, and what the 32 bits of an
immediate mean in ``kvmesh.shared.kv.imm``.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.kv.region import Access, MemoryRegion
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.errors import LocalAccessError

# ---------------------------------------------------------------------------------------------------
# Identity


def local_host_id() -> str:
    """Identifies this machine boot: peers with equal host ids share /dev/shm and loopback."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"


def new_peer_id() -> str:
    """A peer id unique across processes and restarts: ``<hostname>-<pid>-<random>``."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


# ---------------------------------------------------------------------------------------------------
# Writes and windows


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """One scatter-gather element: ``length`` bytes at ``local.addr + local_offset`` <->
    ``[remote_addr, remote_addr + length)`` of the peer's region ``rkey``.

    For ``write`` bytes flow local -> remote; for ``read`` remote -> local.
    """

    local: MemoryRegion
    local_offset: int
    remote_addr: int
    rkey: int
    length: int

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise ValueError(f"WriteEntry.length must be positive, got {self.length}")
        if self.local_offset < 0 or self.local_offset + self.length > self.local.length:
            raise LocalAccessError(
                f"local span [{self.local_offset}, {self.local_offset + self.length}) is outside "
                f"the local region of {self.local.length} bytes (rkey {self.local.rkey})"
            )


ReadEntry = WriteEntry  # same fields; the local region is the destination


@dataclass(frozen=True, slots=True)
class MemoryWindow:
    """A narrower key to part of a registered region.

    Peers that hold ``rkey`` may access exactly ``spans`` (``(addr, length)`` pairs, sorted and
    disjoint, inside region ``region_rkey``) with ``access``, until the window is closed; then
    every access with it is refused. The region's own rkey need never leave the process: a decode
    worker hands each reservation's writer a window over that reservation's blocks alone. On rdma
    the key is resolved into verbs memory windows, one per span (rdma_windows.py).
    ``enforced`` is False where the backend cannot narrow a key (rdma on a NIC without memory
    windows): then ``rkey`` is the region's own and the receiver checks the region's bounds only.
    """

    rkey: int
    region_rkey: int
    spans: tuple[tuple[int, int], ...]
    access: Access
    enforced: bool = True

    def covers(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies inside one span."""
        return any(a <= addr and addr + length <= a + n for a, n in self.spans)


Spans = Sequence[tuple[int, int]]
"""``(addr, length)`` byte ranges of a registered region, the ranges a window opens."""


def merge_spans(spans: Spans) -> tuple[tuple[int, int], ...]:
    """Sorted ``(addr, length)`` spans with touching or overlapping ones joined; lengths > 0."""
    merged: list[list[int]] = []
    for addr, length in sorted(spans):
        if length <= 0:
            raise ValueError(f"a window span needs a positive length, got {length} at {addr:#x}")
        if merged and addr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], addr + length - merged[-1][0])
        else:
            merged.append([addr, length])
    return tuple((a, n) for a, n in merged)


def unenforced_window(region: MemoryRegion, spans: Spans, access: Access) -> MemoryWindow:
    """The window of a backend that cannot narrow keys: the region's own key, spans unchecked."""
    if region.access & access != access:
        raise ValueError(f"region rkey={region.rkey} grants {region.access!r}, not {access!r}")
    return MemoryWindow(region.rkey, region.rkey, merge_spans(spans), access, enforced=False)


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Receiver-side counters (what peers did to this transport's regions)."""

    writes: int = 0  # completed writes
    bytes: int = 0  # bytes placed by completed writes
    refused: int = 0  # writes/reads refused (rkey, bounds, deregistered, access)
    reads: int = 0  # reads served
    read_bytes: int = 0


# ---------------------------------------------------------------------------------------------------
# Protocols


Buffer = torch.Tensor | memoryview | bytearray  # also anything exposing the buffer protocol


@runtime_checkable
class Endpoint(Protocol):
    """A connection to one peer. An async context manager; ``aclose`` fails in-flight operations."""

    @property
    def peer_id(self) -> str: ...

    @property
    def backend(self) -> str: ...

    async def write(self, entries: Sequence[WriteEntry], imm: int) -> None:
        """One batched one-sided write; returns once every byte is placed in the peer's memory.
        Raises RemoteAccessError (refused; nothing outside the target written), PeerGoneError."""
        ...

    async def read(self, entries: Sequence[WriteEntry]) -> None:
        """Pull ``[remote_addr, +length)`` of each entry into its local span; no completion."""
        ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Endpoint: ...

    async def __aexit__(self, *exc: object) -> None: ...


@runtime_checkable
class Transport(Protocol):
    """One data-plane instance per worker. Enter it (``async with``) before use."""

    @property
    def name(self) -> str: ...

    @property
    def peer_id(self) -> str: ...

    @property
    def completion_queue(self) -> CompletionQueue: ...

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Memory this backend can expose to peers: a flat, page-aligned uint8 CPU tensor (shm: in a
        shared-memory segment). Build the receiving KVPool over it. Freed when the transport closes."""
        ...

    def register(self, memory: Buffer, access: Access = Access.LOCAL) -> MemoryRegion: ...

    def deregister(self, region: MemoryRegion) -> None: ...

    def open_window(
        self, region: MemoryRegion, spans: Spans, access: Access = Access.REMOTE_WRITE
    ) -> MemoryWindow:
        """A fresh secret key to ``spans`` of ``region`` alone (see MemoryWindow)."""
        ...

    def close_window(self, window: MemoryWindow) -> None:
        """Every later access with the window's key is refused (a closed window is a no-op)."""
        ...

    def descriptor(self) -> TransportDescriptor:
        """How peers reach this transport: its backends' parts and its remote regions."""
        ...

    async def connect(self, descriptor: TransportDescriptor) -> Endpoint: ...

    def completions(self) -> AsyncIterator[Completion]: ...

    def stats(self) -> TransportStats: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Transport: ...

    async def __aexit__(self, *exc: object) -> None: ...
