"""The advert of a decode worker that is ready and idle, for tests that need one without running
a decode worker (the registry's core, a prefill worker's checks and rigs)."""

from __future__ import annotations

from typing import Any

from kvmesh.shared.bus.messages.workers import DecodeAdvert


def idle_advert(
    worker_id: str,
    descriptor: Any,
    *,
    block_bytes: int,
    block_size: int,
    kv_spec: str,
    total_blocks: int,
) -> DecodeAdvert:
    """A ready, disaggregated decode worker running nothing, every one of its ``total_blocks``
    blocks free (one range); ``msgspec.structs.replace`` makes any other."""
    return DecodeAdvert(
        worker_id=worker_id,
        mode="disagg",
        descriptor=descriptor,
        block_bytes=block_bytes,
        block_size=block_size,
        kv_spec=kv_spec,
        total_blocks=total_blocks,
        free_blocks=total_blocks,
        free_block_ranges=((0, total_blocks),),
        num_running=0,
        num_waiting=0,
        state="ready",
        sent_at=0.0,
    )
