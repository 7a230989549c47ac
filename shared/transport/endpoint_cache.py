"""One transport endpoint per peer descriptor: connected on first use (one connect at a time per
peer), dropped after a failed operation (``forget``: the next use connects again), every one
closed on exit. The prefill worker's writes to decode workers, a TP follower's to decode ranks and
the kv-store client's puts and gets each hold one."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.obs import logs
from kvmesh.shared.transport.base import Endpoint, Transport

log = logs.get_logger(__name__)


class EndpointCache:
    """One endpoint per descriptor, connected on first use, closed by ``aclose`` (or on exit)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._endpoints: dict[bytes, Endpoint] = {}
        self._connecting: dict[bytes, asyncio.Lock] = {}

    @staticmethod
    def _key(descriptor: TransportDescriptor) -> bytes:
        return msgspec.json.encode(descriptor)

    async def get(self, descriptor: TransportDescriptor) -> Endpoint:
        key = self._key(descriptor)
        endpoint = self._endpoints.get(key)
        if endpoint is not None:
            return endpoint
        async with self._connecting.setdefault(key, asyncio.Lock()):
            if key not in self._endpoints:
                self._endpoints[key] = await self.transport.connect(descriptor)
                log.info("connected to peer", peer=descriptor.peer_id)
            return self._endpoints[key]

    async def forget(self, descriptor: TransportDescriptor) -> None:
        endpoint = self._endpoints.pop(self._key(descriptor), None)
        if endpoint is not None:
            with contextlib.suppress(Exception):
                await endpoint.aclose()

    async def aclose(self) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            with contextlib.suppress(Exception):
                await endpoint.aclose()

    async def __aenter__(self) -> EndpointCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
