"""A transport descriptor: how to reach a peer transport's memory, in process and on the wire.

A decode worker advertises one ``TransportDescriptor``; the registry copies it into each
``PlaceReply`` and the router into each ``PrefillJob``. It lists one tagged entry per backend the
worker offers (``{"backend": "shm" | "tcp" | "rdma", ...}``), so a message with an unknown
backend, a missing field or a field of the wrong type is refused when it is decoded, before any
transport sees it.

The fields are data, never trusted paths or endpoints: the transports still check every name
before they use it (``shm_segments.check_segment_name``, ``shm_segments.check_socket_path``),
and a prefill worker writes only where the decode worker itself advertised
(``services/prefill/adverts.py``).

Transports produce and take this type alone: each backend builds its own part (``ShmBackend``,
``TcpBackend``, ``RdmaBackend``) in ``descriptor()`` and reads it back in ``connect``
(``descriptor.backend("tcp")``). The advertised regions are ``MemoryRegion``s (``kv/region.py``),
the very values ``register`` returned. This module imports neither torch nor a transport (the
transport plane sits above this one).
"""

from __future__ import annotations

from typing import Annotated, Literal, overload

import msgspec
from kvmesh.shared.kv.region import U32, U64, MemoryRegion

TcpPort = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class _Backend(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="backend"):
    """One backend's part of a descriptor; the ``backend`` tag names it on the wire."""


class ShmBackend(_Backend, tag="shm"):
    """Same host: the peer's notification socket and its region table segment (a name in
    /dev/shm, never a path)."""

    socket: str
    table: str


class TcpBackend(_Backend, tag="tcp"):
    """Any host: where the peer's TCP transport listens, over how many lanes, and the secret a
    lane proves it knows before the receiver serves it (``transport/lane_auth.py``). It travels
    only over authenticated NATS, like a lease's window key. ``unix``: the receiver's
    same-host lane socket, which writers on its host may dial instead, after checking it
    (``transport/unix_lanes.py``)."""

    host: str
    port: TcpPort
    secret: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    lanes: Annotated[int, msgspec.Meta(ge=1)] = 1
    unix: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class RdmaBackend(_Backend, tag="rdma"):
    """Device facts of an RDMA peer and where to reach its handshake listener (a TCP side
    channel); per-connection QP facts (qpn, psn) travel in the handshake (``rdma_qp.QPInfo``)."""

    device: str
    port: Annotated[int, msgspec.Meta(ge=1, le=255)]
    lid: Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
    gid: str
    gid_index: Annotated[int, msgspec.Meta(ge=0)]
    mtu: Annotated[int, msgspec.Meta(ge=1, le=5)]  # ibv_mtu enum of the port's active MTU
    host: str  # the handshake side channel's (TCP)
    handshake_port: TcpPort
    # rkey -> (addr, iova) for regions whose NIC addresses differ from process addresses
    # (dma-buf registrations of GPU memory): remote_addr - addr + iova is what goes on the wire.
    iova: dict[U32, tuple[U64, U64]] = msgspec.field(default_factory=dict)
    # The memory-window type the peer binds per lease (1 or 2), 0 where its NIC has none: then
    # window keys are region keys and writes are scoped to the region only (docs/security.md).
    memory_windows: Annotated[int, msgspec.Meta(ge=0, le=2)] = 0
    # The side channel's secret (hex): a connection proves it knows it before a QP is made for
    # it (rdma_side_channel.py, lane_auth.side_channel_proof); it travels only in descriptors.
    secret: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] = ""


BackendInfo = ShmBackend | TcpBackend | RdmaBackend


def backend_name(part: BackendInfo) -> str:
    """The tag that names ``part`` on the wire: ``"shm"``, ``"tcp"`` or ``"rdma"``."""
    return part.__struct_config__.tag


class TransportDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Connection info of one transport instance: what ``Transport.descriptor()`` returns, what
    ``connect`` takes, and what travels over NATS. At most one part per backend."""

    peer_id: str
    host_id: str
    backends: tuple[BackendInfo, ...]
    # the remotely accessible regions when the descriptor was made; empty in adverts except on
    # rdma NICs without memory windows (``public()``)
    regions: tuple[MemoryRegion, ...] = ()

    def __post_init__(self) -> None:
        names = self.backend_names
        if len(set(names)) != len(names):
            raise ValueError(f"a descriptor offers each backend once, got {list(names)}")

    @property
    def backend_names(self) -> tuple[str, ...]:
        """The backends this peer offers, in its order."""
        return tuple(backend_name(b) for b in self.backends)

    @overload
    def backend(self, name: Literal["shm"]) -> ShmBackend | None: ...
    @overload
    def backend(self, name: Literal["tcp"]) -> TcpBackend | None: ...
    @overload
    def backend(self, name: Literal["rdma"]) -> RdmaBackend | None: ...
    @overload
    def backend(self, name: str) -> BackendInfo | None: ...

    def backend(self, name: str) -> BackendInfo | None:
        """This peer's part for backend ``name``, if it offers one."""
        return next((b for b in self.backends if backend_name(b) == name), None)

    def public(self) -> TransportDescriptor:
        """This descriptor for broadcast: without its regions' keys (peers get a window's key
        per reservation instead). A descriptor whose rdma part binds no memory windows
        (``memory_windows`` 0: its NIC has none) keeps them, since there a window's key is the
        region's own."""
        rdma = self.backend("rdma")
        if rdma is not None and not rdma.memory_windows:
            return self
        return msgspec.structs.replace(self, regions=())

    def region(self, rkey: int) -> MemoryRegion:
        """The advertised region ``rkey``; KeyError if this peer advertised none."""
        for r in self.regions:
            if r.rkey == rkey:
                return r
        raise KeyError(f"peer {self.peer_id} advertised no region with rkey {rkey}")
