"""A worker's link to the mesh's kv-stores, a ``Feature`` (shared/bus/worker_feature.py) that the
features using a store share: one ``KvStoreClient`` over the worker's pool and one ``StoreBook``
of the stores it may use, fed by their adverts (``REGISTRY_STORE_ADVERTISE``, solicited once the
subscription is open). The features that put or read blocks (decode: finished puts, swaps, local
prefix reads; prefill: prompt prefixes) are built over it; the composition makes it once, the
first of them, so it closes last: the client closes after every put and read in flight ended.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.store_solicit import store_adverts_solicited
from kvmesh.shared.bus.worker_feature import Feature, Route, Site
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.store_book import StoreBook


class StoreLink(Feature):
    def __init__(self, client: KvStoreClient, kv_spec: str) -> None:
        """``kv_spec``: the layout of the blocks this worker puts and reads (a store of another
        is never used)."""
        self.client = client
        self.kv_spec = kv_spec
        self.stores = StoreBook(kv_spec, client.block_bytes)

    async def on_advert(self, advert: StoreAdvert) -> None:
        self.stores.note(advert)

    def routes(self, site: Site) -> Sequence[Route]:
        return ((site.subjects.REGISTRY_STORE_ADVERTISE, StoreAdvert, self.on_advert),)

    def contexts(self, site: Site) -> Sequence[AbstractAsyncContextManager[Any]]:
        return (store_adverts_solicited(site.nc, site.subjects, site.worker_id),)

    async def aclose(self) -> None:
        await self.client.aclose()
