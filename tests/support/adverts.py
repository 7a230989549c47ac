"""The advert of a decode worker (and of a kv-store) that is ready and idle, for tests that need one without running
a decode worker (the registry's core, a prefill worker's checks and rigs)."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from kvmesh.shared.bus.messages.kv_store import StoreAdvert, StoreLoad, StoreReach
from kvmesh.shared.bus.messages.workers import BlockPool, DecodeAdvert, DecodeReach, WorkerLoad


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
    blocks free (one range); ``with_fields`` makes any other."""
    return DecodeAdvert(
        worker_id=worker_id,
        mode="disagg",
        reach=DecodeReach(
            descriptor=descriptor, block_bytes=block_bytes, block_size=block_size, kv_spec=kv_spec
        ),
        load=WorkerLoad("ready", num_running=0, num_waiting=0),
        pool=BlockPool(
            total_blocks=total_blocks,
            free_blocks=total_blocks,
            free_block_ranges=((0, total_blocks),),
        ),
        sent_at=0.0,
    )


def idle_store_advert(
    store_id: str,
    descriptor: Any,
    *,
    kv_spec: str,
    block_bytes: int,
    block_size: int,
    total_blocks: int,
    epoch: str = "e",
) -> StoreAdvert:
    """A ready kv-store holding nothing, asked nothing yet; ``with_fields`` makes any other."""
    reach = StoreReach(descriptor, kv_spec, block_bytes, block_size, epoch)
    return StoreAdvert(
        store_id, reach, StoreLoad("ready", total_blocks, 0, 0, 0, 0, 0, 0, 0, 0), 0.0
    )


M = TypeVar("M", bound=msgspec.Struct)


def with_fields(message: M, **fields: Any) -> M:
    """``message`` (an advert, a heartbeat, a row) with ``fields`` replaced, each in the part
    that holds it: ``with_fields(advert, tp=2, total_blocks=16)`` sets its reach's tp and its
    pool's total_blocks; a field of the message itself is set there."""
    changes: dict[str, Any] = {}
    for field in msgspec.structs.fields(message):
        part = getattr(message, field.name)
        if not isinstance(part, msgspec.Struct):
            continue
        names = {f.name for f in msgspec.structs.fields(part)}
        mine = {k: fields.pop(k) for k in list(fields) if k in names}
        if mine:
            changes[field.name] = msgspec.structs.replace(part, **mine)
    return msgspec.structs.replace(message, **changes, **fields)
