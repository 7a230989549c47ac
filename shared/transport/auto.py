"""Backend selection and the ``create_transport`` factory.

``auto`` serves every backend available here at once over one region table and one completion
queue, advertises all of them in its descriptor, and connects through the best one both peers
support: rdma > shm (same host, segments reachable) > tcp.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import os
from collections.abc import AsyncIterator
from typing import Any

import torch
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.transport.backend import KeyDelegate
from kvmesh.shared.transport.base import (
    Access,
    Endpoint,
    Transport,
    TransportStats,
    local_host_id,
    new_peer_id,
)
from kvmesh.shared.transport.completions import Completion, CompletionQueue
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import BackendUnavailableError, PeerUnreachableError
from kvmesh.shared.transport.registry import Registry
from kvmesh.shared.transport.shm import ShmTransport
from kvmesh.shared.transport.shm_segments import SHM_DIR, check_segment_name, check_socket_path
from kvmesh.shared.transport.tcp import TcpTransport

BACKENDS = ("rdma", "shm", "tcp")  # best first


def rdma_status() -> tuple[bool, str]:
    """Whether the rdma backend can run here, and if not, what is missing."""
    try:
        rdma = importlib.import_module("kvmesh.shared.transport.rdma")
    except ImportError as exc:
        return False, f"kvmesh.shared.transport.rdma cannot be imported ({exc})"
    return rdma.rdma_available()


def shm_status() -> tuple[bool, str]:
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return False, f"{SHM_DIR} is missing or not writable"
    return True, "ok"


def available_backends() -> dict[str, tuple[bool, str]]:
    """``{backend: (available, reason)}`` for this machine."""
    return {"rdma": rdma_status(), "shm": shm_status(), "tcp": (True, "ok")}


def shm_reachable(remote: TransportDescriptor) -> bool:
    info = remote.backend("shm")
    if info is None or remote.host_id != local_host_id():
        return False
    try:
        table = os.path.join(SHM_DIR, check_segment_name(info.table))
        check_socket_path(info.socket)
    except PeerUnreachableError:
        return False
    return os.path.exists(table)


def select_backend(local: TransportDescriptor, remote: TransportDescriptor) -> str:
    """The best backend both descriptors offer; raises PeerUnreachableError if none."""
    ours, theirs = local.backend_names, remote.backend_names
    for name in BACKENDS:
        if name not in ours or name not in theirs:
            continue
        if name == "shm" and not shm_reachable(remote):
            continue
        return name
    raise PeerUnreachableError(
        f"no common backend: this peer offers {sorted(ours)}, peer {remote.peer_id} "
        f"offers {sorted(theirs)}" + (" (shm needs the same host)" if "shm" in theirs else "")
    )


def _require(name: str, status: tuple[bool, str]) -> None:
    """Raise BackendUnavailableError where ``status`` (``shm_status()``, ...) says no."""
    ok, why = status
    if not ok:
        raise BackendUnavailableError(f"{name} backend unavailable: {why}")


def create_transport(name: str = "auto", config: TransportConfig | None = None) -> Transport:
    """``"auto" | "shm" | "tcp" | "rdma"``; enter the result (``async with``) before use."""
    config = config or TransportConfig()
    if name == "shm":
        _require("shm", shm_status())
        return ShmTransport(config)
    if name == "tcp":
        return TcpTransport(config)
    if name == "rdma":
        _require("rdma", rdma_status())
        from kvmesh.shared.transport.rdma import RdmaTransport

        return RdmaTransport(config)
    if name == "auto":
        return AutoTransport(config)
    raise ValueError(f"unknown transport {name!r}; choose auto, shm, tcp or rdma")


class AutoTransport(KeyDelegate):
    """Every available backend over one registry and one completion queue."""

    name = "auto"

    def __init__(self, config: TransportConfig | None = None) -> None:
        config = config or TransportConfig()
        if config.peer_id is None:
            config = dataclasses.replace(config, peer_id=new_peer_id())
        self.config = config
        self._registry = Registry()
        self._queue = CompletionQueue()
        self._backends: dict[str, Any] = {}
        shared = {"registry": self._registry, "completions": self._queue}
        if rdma_status()[0]:
            from kvmesh.shared.transport.rdma import RdmaTransport

            self._backends["rdma"] = RdmaTransport(config, **shared)
        if shm_status()[0]:
            self._backends["shm"] = ShmTransport(config, strict=False, **shared)
        self._backends["tcp"] = TcpTransport(config, **shared)
        # rdma, where there is one, keeps the keys: it registers memory with its NIC (hardware
        # keys) and binds memory windows, mirroring both into the registry for shm/tcp peers
        self._keys = self._backends.get("rdma", self._registry)

    @property
    def peer_id(self) -> str:
        assert self.config.peer_id is not None
        return self.config.peer_id

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._backends)

    @property
    def completion_queue(self) -> CompletionQueue:
        return self._queue

    async def __aenter__(self) -> AutoTransport:
        try:
            for backend in self._backends.values():
                await backend.__aenter__()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(b.aclose() for b in self._backends.values()))
        self._queue.close()

    def allocate(self, nbytes: int) -> torch.Tensor:
        # shm segments also serve tcp (recv_into) and can be registered for rdma
        return self._primary("shm", "tcp").allocate(nbytes)

    def descriptor(self) -> TransportDescriptor:
        parts = tuple(
            backend.backend_info()
            for name, backend in self._backends.items()
            # memory not from allocate(): peers on this host must use tcp
            if name != "shm" or backend.serves_all_regions
        )
        return TransportDescriptor(
            peer_id=self.peer_id,
            host_id=local_host_id(),
            backends=parts,
            regions=tuple(self._registry.regions(Access.REMOTE_WRITE)),
        )

    async def connect(self, descriptor: TransportDescriptor) -> Endpoint:
        name = select_backend(self.descriptor(), descriptor)
        try:
            return await self._backends[name].connect(descriptor)
        except PeerUnreachableError:
            if name == "tcp" or descriptor.backend("tcp") is None:
                raise
            return await self._backends["tcp"].connect(descriptor)

    def completions(self) -> AsyncIterator[Completion]:
        return aiter(self._queue)

    def stats(self) -> TransportStats:
        return self._registry.stats()

    def _primary(self, *names: str) -> Any:
        return next(self._backends[n] for n in names if n in self._backends)
