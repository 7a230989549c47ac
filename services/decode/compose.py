"""How a decode worker is put together from its config: the engine's sizes and its features
(``FEATURES``: each a ``Feature``, shared/bus/worker_feature.py, and a step hook of the engine
loop, ``step_hooks.py``, where it joins the loop). A new feature is a module of its own and one
line in ``FEATURES``; ``worker.py`` and ``service.py`` do not change."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from kvmesh.services.decode.cache_reports import CacheReports
from kvmesh.services.decode.config import DecodeConfig
from kvmesh.services.decode.local_reads import LocalPrefixReads
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.speculation import Speculation
from kvmesh.services.decode.step_hooks import StepHook
from kvmesh.services.decode.store_puts import FinishedPuts
from kvmesh.services.decode.swaps import Swaps
from kvmesh.shared.bus.worker_feature import Feature, Features
from kvmesh.shared.engine.config import EngineConfig, worker_engine_config
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.store_link import StoreLink
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.quant_layers import keeps_weights_stored
from kvmesh.shared.model.tensor_parallel import kv_heads_held
from kvmesh.shared.transport import Transport
from kvmesh.shared.transport.base import MemoryRegion
from nats.aio.client import Client


def engine_config(config: DecodeConfig, model: Any) -> tuple[EngineConfig, KVCacheSpec]:
    dtype = parse_dtype(config.dtype, "--dtype", next(model.parameters()).dtype)
    econf = worker_engine_config(
        config,
        dtype,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_batched_tokens_no_decode=config.max_num_batched_tokens_no_decode,
        reserve_output_tokens=config.reserve_output_tokens,
    )
    # the pool is sized here, as the engine sizes it (a TP rank: its KV heads of the whole
    # model's blocks), so that its memory can be allocated before the engine is made
    spec, num_blocks = econf.pool_layout(
        model.config, dtype, kv_heads_held(model), keeps_weights_stored(model)
    )
    return replace(econf, num_blocks=num_blocks, kv_cache_bytes=None), spec


def build_engine(
    config: DecodeConfig, model: Any, tokenizer: Any, transport: Transport | None
) -> LLMEngine:
    """The engine over ``model``. On the host its pool lives in transport memory (shm: a segment
    the prefill maps); device pools are the engine's own and need a backend that reaches them
    (rdma). ``transport`` None: colocated, no data plane."""
    econf, spec = engine_config(config, model)
    on_host = torch.device(config.device).type == "cpu"
    buffer = (
        transport.allocate(econf.num_blocks * spec.block_bytes)
        if transport is not None and on_host
        else None
    )
    return LLMEngine(model, tokenizer, econf, kv_buffer=buffer)


@dataclass(slots=True)
class DecodeParts:
    """What a decode feature is built from (its ``compose(parts)``): the config, the engine, its
    lock and metrics, the data plane. ``store_link()`` is the kv-store link the features that
    use a store share, made by the first that asks."""

    config: DecodeConfig
    engine: LLMEngine
    worker_id: str
    nc: Client
    transport: Transport | None
    region: MemoryRegion | None
    metrics: DecodeMetrics
    lock: asyncio.Lock  # the engine's, for the hooks whose background work touches the pool
    # the worker's loop's: set by a feature's background work that brings it something to admit
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    link: StoreLink | None = None

    def store_link(self) -> StoreLink | None:
        """The worker's kv-store link; None without ``--use-kv-store``, a data plane (colocated)
        or prefix caching (a store's blocks are adopted as cached prefixes)."""
        region, transport = self.region, self.transport
        if region is None or transport is None or not self.config.use_kv_store:
            return None
        if not self.engine.config.enable_prefix_caching:
            return None
        if self.link is None:
            client = KvStoreClient.for_pool(
                self.nc,
                self.config.subjects,
                transport,
                self.engine.kv_pool,
                region,
                self.worker_id,
            )
            self.link = StoreLink(client, self.engine.kv_spec)
        return self.link


# A decode worker's features, in the order the worker calls their hooks. A feature is a module
# of its own whose class builds itself from the parts (``compose``: None when the config leaves
# it off) and one line here.
FEATURES: tuple[Callable[[DecodeParts], Feature | None], ...] = (
    Speculation.compose,
    FinishedPuts.compose,
    Swaps.compose,
    LocalPrefixReads.compose,
    CacheReports.compose,
)


@dataclass(frozen=True, slots=True)
class DecodeFeatures:
    """What the config turned on: ``features`` in composition order (the store link, when one
    uses it, first), of which ``hooks`` join the engine loop and ``reads`` takes part in how
    local prefills enter (their prefix read from a kv-store first)."""

    features: Features

    @property
    def hooks(self) -> list[StepHook]:
        return self.features.of_type(StepHook)

    @property
    def reads(self) -> LocalPrefixReads | None:
        return next(iter(self.features.of_type(LocalPrefixReads)), None)


def compose_features(
    parts: DecodeParts,
    factories: Sequence[Callable[[DecodeParts], Feature | None]] = FEATURES,
) -> DecodeFeatures:
    """The features ``parts.config`` asks for on this worker (``factories``: FEATURES)."""
    made = [f for factory in factories if (f := factory(parts)) is not None]
    link = parts.link
    return DecodeFeatures(Features([link, *made] if link is not None else made))
