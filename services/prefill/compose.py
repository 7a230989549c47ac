"""How a prefill worker's features are put together from its config (``FEATURES``: each a
``Feature``, shared/bus/worker_feature.py; a ``JobHook``, job_hooks.py, where it joins a job's
life). A new feature is a module of its own and one line in ``FEATURES``; ``worker.py`` and
``service.py`` do not change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.services.prefill.config import PrefillConfig
from kvmesh.services.prefill.draft_writes import DraftKv
from kvmesh.services.prefill.job_hooks import JobHook
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.store_prefix import StorePrefix
from kvmesh.shared.bus.worker_feature import Feature, Features
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.store_link import StoreLink
from kvmesh.shared.transport import MemoryRegion, Transport
from kvmesh.shared.transport.endpoint_cache import EndpointCache
from nats.aio.client import Client


@dataclass(slots=True)
class PrefillParts:
    """What a prefill feature is built from (its ``compose(parts)``): the config, the engine (and
    the draft model's, with ``--draft-model``), their lock, the data plane. ``store_link()`` is
    the kv-store link the features that use a store share, made by the first that asks."""

    config: PrefillConfig
    engine: LLMEngine
    worker_id: str
    kv_spec: str  # the worker's (a TP leader's: its ranks' layout)
    nc: Client
    transport: Transport
    region: MemoryRegion
    endpoints: EndpointCache
    metrics: PrefillMetrics
    lock: asyncio.Lock  # the engines': the worker's, and a hook's that runs an engine
    draft_engine: LLMEngine | None = None
    draft_region: MemoryRegion | None = None
    is_tp: bool = False  # it leads tensor-parallel ranks
    link: StoreLink | None = None

    def store_link(self) -> StoreLink | None:
        """The worker's kv-store link; None without ``--use-kv-store`` or prefix caching, or
        at TP > 1 (a TP worker's ranks hold its blocks' heads apart)."""
        config = self.config
        if not config.use_kv_store or not config.enable_prefix_caching or self.is_tp:
            return None
        if self.link is None:
            client = KvStoreClient.for_pool(
                self.nc, config.subjects, self.transport, self.engine.kv_pool, self.region,
                self.worker_id,
            )  # fmt: skip
            self.link = StoreLink(client, self.kv_spec)
        return self.link


# A prefill worker's job hooks, in the order the worker calls them. A feature is a module of its
# own whose class builds itself from the parts (``compose``: None when the config leaves it off)
# and one line here.
FEATURES: tuple[Callable[[PrefillParts], JobHook | None], ...] = (
    StorePrefix.compose,  # the kv-store's prompt prefixes: read before a job, put after it
    DraftKv.compose,
)


@dataclass(frozen=True, slots=True)
class PrefillFeatures:
    """What the config turned on: ``features`` in composition order (the store link first, when
    one uses it), of which ``hooks`` join each job's life."""

    features: Features

    @property
    def hooks(self) -> list[JobHook]:
        return self.features.of_type(JobHook)


def compose_features(
    parts: PrefillParts,
    factories: Sequence[Callable[[PrefillParts], Feature | None]] = FEATURES,
) -> PrefillFeatures:
    """The features ``parts.config`` asks for on this worker (``factories``: FEATURES)."""
    made = [f for factory in factories if (f := factory(parts)) is not None]
    first = [parts.link] if parts.link is not None else []  # closed after its users
    return PrefillFeatures(Features([*first, *made]))
