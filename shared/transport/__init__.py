"""KV data plane: verbs-like one-sided writes with immediate data (shm, tcp, rdma, auto).

See docs/transport.md. Typical use::

    async with create_transport("auto", config) as transport:
        pool = KVPool(spec, n, buffer=transport.allocate(n * spec.block_bytes))
        region = transport.register(pool.raw, Access.REMOTE_WRITE)
        publish(transport.descriptor())  # a TransportDescriptor, over NATS
"""

from kvmesh.shared.transport.auto import available_backends, create_transport, select_backend
from kvmesh.shared.transport.base import (
    Access,
    Endpoint,
    MemoryRegion,
    MemoryWindow,
    ReadEntry,
    Transport,
    TransportDescriptor,
    TransportStats,
    WriteEntry,
    local_host_id,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    BackendUnavailableError,
    LocalAccessError,
    PeerGoneError,
    PeerUnreachableError,
    ProtocolError,
    RefusalReason,
    RemoteAccessError,
    TransportClosedError,
    TransportError,
)
from kvmesh.shared.transport.registry import Registry, as_byte_tensor

__all__ = [
    "Access",
    "BackendUnavailableError",
    "Completion",
    "CompletionQueue",
    "Endpoint",
    "LocalAccessError",
    "MemoryRegion",
    "MemoryWindow",
    "PeerGoneError",
    "PeerUnreachableError",
    "ProtocolError",
    "ReadEntry",
    "RefusalReason",
    "Registry",
    "RemoteAccessError",
    "Transport",
    "TransportClosedError",
    "TransportConfig",
    "TransportDescriptor",
    "TransportError",
    "TransportStats",
    "WriteEntry",
    "as_byte_tensor",
    "available_backends",
    "create_transport",
    "local_host_id",
    "select_backend",
]
