"""What every transport backend shares (shm, tcp, rdma): its config and peer id, the registry of
its regions, the queue its completions land in, its open endpoints, its descriptor (the
backend's own typed part, ``backend_info()``, with its remote regions), the peer's part that
``connect`` reads (``peer_part``), and ``async with`` (``start``; ``aclose`` closes the
endpoints, then the backend's own ``_teardown``).

``KeyDelegate`` hands registrations and windows to whatever keeps a transport's keys:
``HostMemoryBackend`` (shm, tcp) to its registry (rdma registers memory with its NIC instead),
``auto`` to its rdma backend where there is one. ``EndpointBase`` is what every backend's
endpoint shares: the peer it reaches, ``async with``, and a once-only ``aclose``."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Generic, Self, TypeVar

from kvmesh.shared.kv.descriptor import RdmaBackend, ShmBackend, TcpBackend, TransportDescriptor
from kvmesh.shared.transport.base import (
    Access,
    Buffer,
    MemoryRegion,
    MemoryWindow,
    Spans,
    TransportStats,
    local_host_id,
    new_peer_id,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import PeerUnreachableError, TransportClosedError
from kvmesh.shared.transport.registry import Registry

if TYPE_CHECKING:
    from kvmesh.shared.transport.rdma import RdmaTransport

Part = TypeVar("Part", ShmBackend, TcpBackend, RdmaBackend)


class BackendBase(abc.ABC, Generic[Part]):
    """``name`` is the backend's tag in descriptors; ``part`` the type of its descriptor part."""

    name: str
    part: type[Part]

    def __init__(
        self,
        config: TransportConfig | None,
        registry: Registry | None,
        completions: CompletionQueue | None,
    ) -> None:
        self.config = config or TransportConfig()
        self._peer_id = self.config.peer_id or new_peer_id()
        self._registry = registry if registry is not None else Registry()
        self._queue = completions if completions is not None else CompletionQueue()
        self._endpoints: set[EndpointBase] = set()  # open ones, closed with the transport
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    @property
    def completion_queue(self) -> CompletionQueue:
        return self._queue

    def completions(self) -> AsyncIterator[Completion]:
        return aiter(self._queue)

    def stats(self) -> TransportStats:
        return self._registry.stats()

    @abc.abstractmethod
    def backend_info(self) -> Part:
        """This backend's part of the descriptor: how a peer reaches it (once started)."""

    def remote_regions(self) -> tuple[MemoryRegion, ...]:
        """The regions peers may write, as the descriptor advertises them."""
        return tuple(self._registry.regions(Access.REMOTE_WRITE))

    def descriptor(self) -> TransportDescriptor:
        return TransportDescriptor(
            peer_id=self._peer_id,
            host_id=local_host_id(),
            backends=(self.backend_info(),),
            regions=self.remote_regions(),
        )

    def peer_part(self, descriptor: TransportDescriptor) -> Part:
        """The part of ``descriptor`` this backend connects through; PeerUnreachableError if the
        peer offers none."""
        part = next((b for b in descriptor.backends if isinstance(b, self.part)), None)
        if part is None:
            raise PeerUnreachableError(
                f"peer {descriptor.peer_id} offers no {self.name} backend (it offers "
                f"{list(descriptor.backend_names)})"
            )
        return part

    def forget_endpoint(self, endpoint: EndpointBase) -> None:
        """Called by an endpoint as it closes."""
        self._endpoints.discard(endpoint)

    def _check_not_closed(self) -> None:
        if self._closed:
            raise TransportClosedError(f"{self.name} transport is closed")

    @abc.abstractmethod
    async def start(self) -> None: ...

    async def aclose(self) -> None:
        """Close every endpoint, then what ``start`` set up; a second call is a no-op."""
        if self._closed:
            return
        self._closed = True
        for ep in list(self._endpoints):
            await ep.aclose()
        await self._teardown()

    @abc.abstractmethod
    async def _teardown(self) -> None:
        """Release what ``start`` set up (the first ``aclose`` only, after the endpoints)."""

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class KeyDelegate:
    """``register``, ``deregister``, ``open_window`` and ``close_window`` of a transport whose
    keys another object keeps (``_keys``: a Registry, or an rdma backend)."""

    _keys: Registry | RdmaTransport

    def register(self, memory: Buffer, access: Access = Access.LOCAL) -> MemoryRegion:
        return self._keys.register(memory, access)

    def deregister(self, region: MemoryRegion) -> None:
        self._keys.deregister(region)

    def open_window(
        self, region: MemoryRegion, spans: Spans, access: Access = Access.REMOTE_WRITE
    ) -> MemoryWindow:
        return self._keys.open_window(region, spans, access)

    def close_window(self, window: MemoryWindow) -> None:
        """Later accesses with the window's key are refused; closing twice is a no-op."""
        self._keys.close_window(window)


class HostMemoryBackend(KeyDelegate, BackendBase[Part]):
    """A backend over host memory: its registry keeps its keys."""

    @property
    def _keys(self) -> Registry:
        return self._registry


class EndpointBase(abc.ABC):
    """A connection to one peer (base.Endpoint); ``aclose`` runs ``_teardown`` once."""

    backend: str

    def __init__(self, peer_id: str) -> None:
        self._peer_id = peer_id
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self._peer_id

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._teardown()

    @abc.abstractmethod
    async def _teardown(self) -> None:
        """Release the connection (the first ``aclose`` only; ``_closed`` is already set)."""
