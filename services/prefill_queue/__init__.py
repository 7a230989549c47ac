"""prefill-queue: watches the mesh's JetStream prefill queue (stream and consumer).

Its NATS user may only read the queue's INFO (docs/security.md): it says when the queue is
missing or not as kvmesh makes it, and exports its depth. ``admin`` makes the queue (`kvmesh up`
at start, `kvmesh admin prefill-queue` for compose and an operator's server); on a server that
asks for no credentials the keeper makes it itself. `kvmesh up` and compose run it; an operator
runs one per mesh (`kvmesh serve prefill-queue`, as user ``prefill-queue``). It reads no mesh
message. Follows the ``kvmesh serve`` contract: ``CONFIG`` and ``async run(config)``."""

from __future__ import annotations

from kvmesh.services.prefill_queue.config import QueueKeeperConfig

CONFIG = QueueKeeperConfig


async def run(config: QueueKeeperConfig) -> None:
    from kvmesh.services.prefill_queue.service import run_keeper

    await run_keeper(config)


__all__ = ["CONFIG", "run"]
