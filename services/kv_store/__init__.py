"""kv-store: a memory node holding KV blocks by prefix hash, written and read one-sided.

Follows the ``kvmesh serve`` contract: ``CONFIG`` and ``async run(config)``; torch, the transport
and NATS load on ``run`` only (docs/kv_store.md)."""

from __future__ import annotations

from kvmesh.services.kv_store.config import StoreConfig

CONFIG = StoreConfig


async def run(config: StoreConfig) -> None:
    from kvmesh.services.kv_store.service import run_store

    await run_store(config)


__all__ = ["CONFIG", "StoreConfig", "run"]
