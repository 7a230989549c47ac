"""The wire form of a transport descriptor: how to reach a decode worker's KV memory.

A decode worker advertises one ``TransportDescriptor``; the registry copies it into each
``PlaceReply`` and the router into each ``PrefillJob``. It lists one tagged entry per backend the
worker offers (``{"backend": "shm" | "tcp" | "rdma", ...}``), so a message with an unknown
backend, a missing field or a field of the wrong type is refused when it is decoded, before any
transport sees it.

The fields are data, never trusted paths or endpoints: the transports still check every name
before they use it (``shm.check_segment_name``, ``shm.check_socket_path``), and a prefill worker
writes only where the decode worker itself advertised (``services/prefill/adverts.py``).

In-process, transports speak ``kvmesh.shared.transport.PeerDescriptor``;
``TransportDescriptor.from_peer`` and ``PeerDescriptor.from_wire`` convert through its
``to_dict``/``from_dict`` shape, so this module imports neither torch nor a transport (the
transport plane sits above this one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec

if TYPE_CHECKING:
    from kvmesh.shared.transport.base import PeerDescriptor

U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64
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
    only over authenticated NATS, like a lease's window key."""

    host: str
    port: TcpPort
    secret: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    lanes: Annotated[int, msgspec.Meta(ge=1)] = 1


class RdmaBackend(_Backend, tag="rdma"):
    """Device facts of an RDMA peer and its handshake listener (``transport.rdma_device
    .RdmaPeerInfo``); per-connection QP facts travel in the handshake."""

    device: str
    port: Annotated[int, msgspec.Meta(ge=1, le=255)]
    lid: Annotated[int, msgspec.Meta(ge=0, le=0xFFFF)]
    gid: str
    gid_index: Annotated[int, msgspec.Meta(ge=0)]
    mtu: Annotated[int, msgspec.Meta(ge=1, le=5)]  # ibv_mtu enum
    host: str
    handshake_port: TcpPort
    # rkey -> (addr, iova) of regions whose NIC addresses differ from process addresses
    iova: dict[U32, tuple[U64, U64]] = msgspec.field(default_factory=dict)
    # the memory-window type bound per lease (1 or 2); 0 where the NIC has none
    memory_windows: Annotated[int, msgspec.Meta(ge=0, le=2)] = 0
    # the side channel's secret: a connection proves it knows it before a QP is made for it
    secret: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] = ""


BackendInfo = ShmBackend | TcpBackend | RdmaBackend


class RegionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A remotely accessible region (``transport.MemoryRegion``)."""

    addr: U64
    length: U64
    rkey: U32
    access: Annotated[int, msgspec.Meta(ge=0, le=3)] = 0  # transport.Access flags
    lkey: U32 = 0


class TransportDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Connection info of one transport instance, as it travels over NATS."""

    peer_id: str
    host_id: str
    backends: tuple[BackendInfo, ...]
    # empty in adverts except on rdma NICs without memory windows (PeerDescriptor.public())
    regions: tuple[RegionInfo, ...] = ()

    @classmethod
    def from_peer(cls, peer: PeerDescriptor) -> TransportDescriptor:
        """The wire form of a transport's own descriptor. Raises ``msgspec.ValidationError`` if a
        transport describes itself with a field this schema does not know (a test checks every
        backend)."""
        d = peer.to_dict()
        backends = [{"backend": name, **info} for name, info in d["backends"].items()]
        return msgspec.convert({**d, "backends": backends}, cls, strict=False)

    def to_dict(self) -> dict[str, Any]:
        """``PeerDescriptor.to_dict()``'s shape: backends keyed by name."""
        backends = {}
        for backend in self.backends:
            info = msgspec.to_builtins(backend)
            backends[info.pop("backend")] = info
        regions = [msgspec.to_builtins(r) for r in self.regions]
        return {
            "peer_id": self.peer_id,
            "host_id": self.host_id,
            "backends": backends,
            "regions": regions,
        }

    def backend(self, name: str) -> BackendInfo | None:
        """This peer's part for backend ``name``, if it offers one."""
        return next((b for b in self.backends if b.__struct_config__.tag == name), None)
