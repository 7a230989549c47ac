"""kv-registry: decode placement, leases and the worker table; answers the admin subjects.

Follows the ``kvmesh serve`` contract: ``CONFIG`` and ``async run(config)``. The asyncio shell is
imported on ``run`` only, so parsing flags stays cheap."""

from __future__ import annotations

from kvmesh.services.kv_registry.config import RegistryConfig

CONFIG = RegistryConfig


async def run(config: RegistryConfig) -> None:
    from kvmesh.services.kv_registry.service import run_registry

    await run_registry(config)


__all__ = ["CONFIG", "run"]
