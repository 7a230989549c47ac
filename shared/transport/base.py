"""The KV data plane API: verbs-like one-sided writes with immediate data.

Every backend (``shm``, ``tcp``, ``rdma``) keeps RDMA semantics so that RDMA is a thin shim:

* ``register(memory, access) -> MemoryRegion(addr, length, rkey)``: local memory the backend may read
  (source of writes) or expose to peers (``Access.REMOTE_WRITE`` / ``REMOTE_READ``).
* ``descriptor() -> PeerDescriptor``: small, JSON-able; travels over NATS to peers.
* ``await connect(descriptor) -> Endpoint``; ``await endpoint.write(entries, imm)`` returns once the
  bytes are *placed* in the remote memory; the receiver then gets exactly one ``Completion`` per
  write, in write order per endpoint, from ``transport.completions()``.
* Addresses in ``WriteEntry.remote_addr`` are in the *receiver's* address space (as in RDMA);
  ``MemoryRegion.addr`` is the registering process's address of the first byte.
* A write that breaks the registration (unknown or deregistered rkey, bounds, access) is refused:
  ``RemoteAccessError`` on the writer, ``stats().refused`` on the receiver, no byte written outside
  the target region.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import secrets
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

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
# Errors


class TransportError(Exception):
    """Base class of every data-plane error."""


class RefusalReason(enum.IntEnum):
    """Why a remote access was refused; travels on the wire (tcp NAK, shm notification)."""

    UNKNOWN_RKEY = 1
    DEREGISTERED = 2
    OUT_OF_BOUNDS = 3
    ACCESS_DENIED = 4
    BAD_LENGTH = 5


_REASON_HINTS = {
    RefusalReason.UNKNOWN_RKEY: "rkey was never registered on the receiver; use the rkey from its "
    "MemoryRegion/PeerDescriptor",
    RefusalReason.DEREGISTERED: "the region was deregistered on the receiver; fetch a fresh "
    "descriptor before writing again",
    RefusalReason.OUT_OF_BOUNDS: "[remote_addr, remote_addr+length) is outside the registered "
    "region [addr, addr+length)",
    RefusalReason.ACCESS_DENIED: "the region was not registered with the access this operation "
    "needs (REMOTE_WRITE for write, REMOTE_READ for read)",
    RefusalReason.BAD_LENGTH: "length must be positive and at most the transport's max frame size",
}


class RemoteAccessError(TransportError):
    """The target refused a write or read: bad rkey, out of bounds, deregistered, wrong access."""

    def __init__(self, reason: RefusalReason, detail: str = "") -> None:
        self.reason = RefusalReason(reason)
        self.detail = detail
        msg = f"remote access refused ({self.reason.name.lower()}): {_REASON_HINTS[self.reason]}"
        super().__init__(f"{msg}; {detail}" if detail else msg)


class LocalAccessError(TransportError):
    """A WriteEntry's local side is outside its local MemoryRegion, or the region is unknown."""


class PeerUnreachableError(TransportError):
    """connect() could not reach the peer through any backend both sides support."""


class PeerGoneError(TransportError):
    """The peer vanished (process died, connection reset) while an operation was in flight."""


class ProtocolError(TransportError):
    """A peer sent a corrupt or truncated frame; the connection is closed."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot run here; the message says what is missing."""


class TransportClosedError(TransportError):
    """The transport or endpoint was closed."""


# ---------------------------------------------------------------------------------------------------
# Memory registration


class Access(enum.IntFlag):
    """What a registration allows. Local access is always granted to the registering process."""

    LOCAL = 0
    REMOTE_WRITE = 1
    REMOTE_READ = 2
    REMOTE = REMOTE_WRITE | REMOTE_READ


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    """A registered span ``[addr, addr + length)`` in the registering process's address space.

    ``rkey`` names the registration to peers (and locally, to find the memory again);
    ``lkey`` is for backends that have one (rdma), 0 elsewhere.
    """

    addr: int
    length: int
    rkey: int
    access: Access = Access.LOCAL
    lkey: int = 0

    @property
    def end(self) -> int:
        return self.addr + self.length

    def to_dict(self) -> dict[str, int]:
        return {
            "addr": self.addr,
            "length": self.length,
            "rkey": self.rkey,
            "access": int(self.access),
            "lkey": self.lkey,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryRegion:
        return cls(
            addr=int(d["addr"]),
            length=int(d["length"]),
            rkey=int(d["rkey"]),
            access=Access(int(d.get("access", 0))),
            lkey=int(d.get("lkey", 0)),
        )


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


def merge_spans(spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
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


def unenforced_window(
    region: MemoryRegion, spans: Sequence[tuple[int, int]], access: Access
) -> MemoryWindow:
    """The window of a backend that cannot narrow keys: the region's own key, spans unchecked."""
    if region.access & access != access:
        raise ValueError(f"region rkey={region.rkey} grants {region.access!r}, not {access!r}")
    return MemoryWindow(region.rkey, region.rkey, merge_spans(spans), access, enforced=False)


@dataclass(frozen=True, slots=True)
class Completion:
    """Delivered to the receiver once per successful write, after all its bytes are placed.

    ``rkey`` is the key the write used (a window's or a region's), so that the receiver can tell
    whose authority an immediate came with; None where the backend cannot tell (rdma: the
    immediate arrives without it)."""

    imm: int
    peer_id: str
    num_bytes: int
    rkey: int | None = None


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Receiver-side counters (what peers did to this transport's regions)."""

    writes: int = 0  # completed writes
    bytes: int = 0  # bytes placed by completed writes
    refused: int = 0  # writes/reads refused (rkey, bounds, deregistered, access)
    reads: int = 0  # reads served
    read_bytes: int = 0


# ---------------------------------------------------------------------------------------------------
# Peer descriptor: what a peer needs to connect; orjson-able through to_dict / from_dict.


@dataclass(frozen=True, slots=True)
class PeerDescriptor:
    """Connection info of one transport instance.

    ``backends`` maps a backend name to its connection info (plain JSON types):
      * ``"shm"``: ``{"socket": "/path/notify.sock", "table": "<region table segment>",
        "segments": {"<rkey>": "<segment name>"}}`` (segments live in /dev/shm)
      * ``"tcp"``: ``{"host": "10.0.0.2", "port": 41234, "lanes": 4}``
      * ``"rdma"``: defined by shared/transport/rdma.py (device, qpn, gid, psn, mtu, handshake).
    ``regions`` lists the remotely accessible regions at the time the descriptor was made.
    """

    peer_id: str
    host_id: str
    backends: Mapping[str, Mapping[str, Any]]
    regions: tuple[MemoryRegion, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "host_id": self.host_id,
            "backends": {k: dict(v) for k, v in self.backends.items()},
            "regions": [r.to_dict() for r in self.regions],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PeerDescriptor:
        try:
            return cls(
                peer_id=str(d["peer_id"]),
                host_id=str(d["host_id"]),
                backends={str(k): dict(v) for k, v in d["backends"].items()},
                regions=tuple(MemoryRegion.from_dict(r) for r in d.get("regions", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"malformed PeerDescriptor {d!r}: {exc}") from exc

    def public(self) -> PeerDescriptor:
        """This descriptor for broadcast: without its regions' keys (peers get a window's key
        per reservation instead). A descriptor whose rdma part binds no memory windows
        (``memory_windows`` 0: its NIC has none) keeps them, since there a window's key is the
        region's own."""
        rdma = self.backends.get("rdma")
        if rdma is not None and not rdma.get("memory_windows"):
            return self
        return PeerDescriptor(self.peer_id, self.host_id, self.backends, regions=())

    def region(self, rkey: int) -> MemoryRegion:
        for r in self.regions:
            if r.rkey == rkey:
                return r
        raise KeyError(f"peer {self.peer_id} advertised no region with rkey {rkey}")


# ---------------------------------------------------------------------------------------------------
# Completion queue: filled by backend threads, drained by the receiver's event loop.


class CompletionQueue:
    """Thread-safe producer side (``put``), asyncio consumer side (``get`` / ``async for``)."""

    def __init__(self) -> None:
        self._items: deque[Completion] = deque()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False

    def put(self, completion: Completion) -> None:
        """Callable from any thread."""
        with self._lock:
            if self._closed:
                return
            self._items.append(completion)
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            _wake(loop, fut)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            _wake(loop, fut)

    def get_nowait(self) -> Completion | None:
        with self._lock:
            return self._items.popleft() if self._items else None

    def qsize(self) -> int:
        return len(self._items)

    async def get(self) -> Completion:
        """Next completion; raises TransportClosedError once closed and drained."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise TransportClosedError("completion queue closed")
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def __aiter__(self) -> AsyncIterator[Completion]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Completion]:
        while True:
            try:
                yield await self.get()
            except TransportClosedError:
                return


def _wake(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    def _set() -> None:
        if not fut.done():
            fut.set_result(None)

    if loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):  # loop closed in between
        loop.call_soon_threadsafe(_set)


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
        self,
        region: MemoryRegion,
        spans: Sequence[tuple[int, int]],
        access: Access = Access.REMOTE_WRITE,
    ) -> MemoryWindow:
        """A fresh secret key to ``spans`` of ``region`` alone (see MemoryWindow)."""
        ...

    def close_window(self, window: MemoryWindow) -> None:
        """Every later access with the window's key is refused (a closed window is a no-op)."""
        ...

    def descriptor(self) -> PeerDescriptor: ...

    async def connect(self, descriptor: PeerDescriptor) -> Endpoint: ...

    def completions(self) -> AsyncIterator[Completion]: ...

    def stats(self) -> TransportStats: ...

    async def aclose(self) -> None: ...

    async def __aenter__(self) -> Transport: ...

    async def __aexit__(self, *exc: object) -> None: ...


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Options for every backend; build once from flags / ``KVMESH_*`` env and pass down."""

    peer_id: str | None = None  # default: "<hostname>-<pid>-<random>"
    tcp_host: str = "127.0.0.1"  # address to listen on
    tcp_advertise_host: str | None = None  # address peers dial; default tcp_host
    tcp_port: int = 0  # 0: any free port
    tcp_lanes: int = 2  # sockets per endpoint (more help on many-core hosts)
    tcp_window: int = 8  # in-flight bytes per lane = tcp_window * tcp_slice_bytes (backpressure)
    tcp_slice_bytes: int = 4 << 20  # large writes are cut into slices of at most this many bytes
    shm_dir: str | None = None  # where the notification socket lives; default a fresh temp dir
    rdma_device: str | None = None  # e.g. "mlx5_0" / "rxe0"; None: first active device
    rdma_gid_index: int | None = None
    connect_timeout_s: float = 10.0
    op_timeout_s: float = 60.0  # a write/read not placed by then fails with PeerGoneError
    # Receivers: at most this many connections at once (each holds a thread), and a peer that
    # has not finished its hello within handshake_timeout_s is disconnected.
    max_connections: int = 256
    handshake_timeout_s: float = 5.0
    extra: Mapping[str, Any] = field(default_factory=dict)  # backend-specific knobs

    def __post_init__(self) -> None:
        if not 0 <= self.tcp_port < 65536:
            raise ValueError(f"tcp_port must be in [0, 65536), got {self.tcp_port}")
        for name in ("tcp_lanes", "tcp_window"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"{name} must be in [1, 64], got {getattr(self, name)}")
        if not 4096 <= self.tcp_slice_bytes <= 1 << 30:
            raise ValueError(
                f"tcp_slice_bytes must be in [4 KiB, 1 GiB], got {self.tcp_slice_bytes}"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("connect_timeout_s", "op_timeout_s", "handshake_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
