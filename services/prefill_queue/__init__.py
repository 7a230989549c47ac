"""prefill-queue: makes and keeps the mesh's JetStream prefill queue (stream and consumer).

The one NATS user that may create or update them (docs/security.md): `kvmesh up` runs it, and so
does compose; an operator with a server of their own runs it once per mesh
(`kvmesh serve prefill-queue`, as user ``prefill-queue``). It reads no mesh message. Follows the
``kvmesh serve`` contract: ``CONFIG`` and ``async run(config)``."""

from __future__ import annotations

from kvmesh.services.prefill_queue.config import QueueKeeperConfig

CONFIG = QueueKeeperConfig


async def run(config: QueueKeeperConfig) -> None:
    from kvmesh.services.prefill_queue.service import run_keeper

    await run_keeper(config)


__all__ = ["CONFIG", "run"]
