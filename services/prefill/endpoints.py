"""The prefill worker's connections to decode workers: one endpoint per advertised descriptor,
connected on first use, dropped after a failed write, closed on exit."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Endpoint, Transport

log = logs.get_logger(__name__)


class EndpointCache:
    """One endpoint per decode descriptor, connected on first use, closed on exit."""

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
                log.info("connected to decode worker", peer=descriptor.peer_id)
            return self._endpoints[key]

    async def forget(self, descriptor: TransportDescriptor) -> None:
        endpoint = self._endpoints.pop(self._key(descriptor), None)
        if endpoint is not None:
            with contextlib.suppress(Exception):
                await endpoint.aclose()

    async def __aenter__(self) -> EndpointCache:
        return self

    async def __aexit__(self, *exc: object) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for endpoint in endpoints:
            with contextlib.suppress(Exception):
                await endpoint.aclose()
