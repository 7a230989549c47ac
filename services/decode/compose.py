"""How a decode worker is put together from its config: the engine's sizes and the features of
its engine loop (step hooks, ``step_hooks.py``) and around it. A new feature of the loop is a
hook of its own module and one line here; ``worker.py`` does not change."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from kvmesh.services.decode.cache_reports import CacheReporter
from kvmesh.services.decode.config import DecodeConfig
from kvmesh.services.decode.drafts import DraftBook
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.speculation import Speculation
from kvmesh.services.decode.step_hooks import StepHook
from kvmesh.services.decode.store_puts import FinishedPuts
from kvmesh.services.decode.swaps import Swaps
from kvmesh.shared.engine.config import EngineConfig, worker_engine_config
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.mesh.kv_store_client import KvStoreClient
from kvmesh.shared.mesh.kv_store_prefix import PrefixReader
from kvmesh.shared.model.config import parse_dtype
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
    # the pool is sized here, for all the model's KV heads (a TP rank's share: tp_group.py), so
    # that its memory can be allocated before the engine is made
    spec = econf.pool_spec(model.config, dtype)
    num_blocks = econf.resolve_num_blocks(spec.block_bytes)
    return replace(econf, num_blocks=num_blocks, kv_cache_bytes=None), spec


@dataclass(frozen=True, slots=True)
class DecodeFeatures:
    """What the config turned on. ``hooks``: the engine loop's, in the order the worker calls
    them; the others are fed by the service (proposals, store adverts) or read by it (cache
    reports), or take part in how requests enter (``reader``)."""

    speculation: Speculation | None = None
    store: FinishedPuts | None = None
    swaps: Swaps | None = None
    reader: PrefixReader | None = None
    cache: CacheReporter | None = None

    @property
    def hooks(self) -> list[StepHook]:
        return [h for h in (self.speculation, self.store, self.swaps) if h is not None]


def compose_features(
    config: DecodeConfig,
    engine: LLMEngine,
    worker_id: str,
    nc: Client,
    transport: Transport | None,
    region: MemoryRegion | None,
    metrics: DecodeMetrics,
    lock: asyncio.Lock,
) -> DecodeFeatures:
    """The features ``config`` asks for on this worker. ``lock``: the engine's, for the hooks
    whose background work touches the pool (puts, swap-ins, prefix reads)."""
    store = swaps = reader = None
    caching = engine.config.enable_prefix_caching
    if region is not None and transport is not None and config.use_kv_store and caching:
        client = KvStoreClient.for_pool(
            nc, config.subjects, transport, engine.kv_pool, region, worker_id
        )
        store = FinishedPuts(engine, client, engine.kv_spec, lock)
        swaps = Swaps(engine, client, store.stores, engine.kv_spec, metrics, lock)
        reader = PrefixReader(
            client, store.stores, engine.kv_spec, engine.block_manager, engine.kv_pool
        )
    return DecodeFeatures(
        speculation=Speculation(DraftBook(worker_id), metrics) if config.speculative else None,
        store=store,
        swaps=swaps,
        reader=reader,
        cache=(
            CacheReporter(worker_id, engine.block_manager, config.max_cache_events)
            if caching
            else None
        ),
    )
