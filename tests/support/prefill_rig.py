"""A prefill worker with no NATS: an engine, a real tcp transport, and a "decode" side that is
only a registered region the worker writes into, advertised as a ready decode worker."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.shared.bus.messages.placement import DecodeRankTarget
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.text.sampling import SamplingOptions

from support.adverts import idle_advert, with_fields


def ready_advert(
    descriptor: Any, region: Any, spec: Any, kv_spec: str, worker_id: str = "d0"
) -> DecodeAdvert:
    """The advert of a ready, idle disaggregated decode worker whose whole KV pool is ``region``
    (in ``spec``'s layout, every block free)."""
    return idle_advert(
        worker_id,
        descriptor,
        block_bytes=spec.block_bytes,
        block_size=spec.block_size,
        kv_spec=kv_spec,
        total_blocks=region.length // spec.block_bytes,
    )


@contextlib.asynccontextmanager
async def prefill_rig(
    engine: Any,
    *,
    kv_spec: str,
    decode_spec: Any = None,
    decode_kv_spec: str | None = None,
    remote_blocks: int = 64,
    **worker_options: Any,
) -> AsyncIterator[tuple[Any, Any, Any, Any]]:
    """A running ``PrefillWorker`` on ``engine`` (its KV layout ``kv_spec``) that knows one
    decode worker, "d0": ``remote_blocks`` blocks of ``decode_spec``'s layout (default: the
    engine's) behind a tcp transport, advertised with ``decode_kv_spec`` (default ``kv_spec``).
    Yields (worker, decode transport, the decode region, its memory)."""
    from kvmesh.services.prefill.worker import PrefillWorker
    from kvmesh.shared.transport import Access, TransportConfig, create_transport
    from kvmesh.shared.transport.endpoint_cache import EndpointCache

    from support.transport_wire import remote as remote_key

    decode_spec = decode_spec or engine.kv_pool.spec
    async with (
        create_transport("tcp", TransportConfig(peer_id="decode")) as decode_side,
        create_transport("tcp", TransportConfig(peer_id="prefill")) as prefill_side,
        EndpointCache(prefill_side) as endpoints,  # connected on first use, as the service does
    ):
        remote = decode_side.allocate(remote_blocks * decode_spec.block_bytes)
        region = remote_key(decode_side, decode_side.register(remote, Access.REMOTE_WRITE))
        worker = PrefillWorker(
            engine,
            prefill_side.register(engine.kv_pool.raw),
            endpoints,
            worker_id="p0",
            kv_spec=kv_spec,
            advert_wait_s=0.2,
            **worker_options,
        )
        advert_spec = decode_kv_spec or kv_spec
        worker.adverts.note(
            ready_advert(decode_side.descriptor(), region, decode_spec, advert_spec)
        )
        loop = asyncio.create_task(worker.run())
        try:
            yield worker, decode_side, region, remote
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop


def prefill_job(
    worker: Any,
    request_id: str,
    prompt: Any,
    region: Any,
    block_ids: Any,
    *,
    block_bytes: int | None = None,
    descriptor: Any = None,
) -> PrefillJob:
    """A greedy job for "d0" whose KV goes to ``block_ids`` of ``region`` (blocks of
    ``block_bytes``, default the worker's), reaching it by ``descriptor`` (default: as "d0"
    advertised)."""
    block_bytes = block_bytes or worker.block_bytes
    return PrefillJob(
        request_id,
        tuple(prompt),
        SamplingOptions(temperature=0.0),
        "d0",
        "L" + request_id,
        worker.adverts.get("d0").reach.descriptor if descriptor is None else descriptor,
        region.rkey,
        tuple(region.addr + b * block_bytes for b in block_ids),
        block_bytes,
        enqueued_at=0.0,
    )


def tp2_job(
    worker: Any,
    side: Any,
    region0: Any,
    spec: Any,
    prompt: Any,
    rkey: int,
    addrs: Any,
    rank1: tuple[int, Any, Any],
    block_bytes: tuple[int, int] | None = None,
) -> PrefillJob:
    """A greedy job "tp" (lease "Ltp") for "d1", a ready decode worker of two ranks that it
    notes in ``worker``'s adverts (advertised by ``side`` with ``region0``; 16 blocks a rank of
    ``block_bytes`` each (default: half ``spec``'s, each rank one of two KV heads)): rank 0's
    blocks by ``rkey`` at ``addrs``, rank 1's by the key, addresses and descriptor of ``rank1``
    (descriptor None: the one "d1" advertised)."""
    half = spec.block_bytes // 2
    bytes0, bytes1 = block_bytes or (half, half)
    advert = ready_advert(side.descriptor(), region0, spec, "s", worker_id="d1")
    worker.adverts.note(with_fields(advert, block_bytes=bytes0, tp=2, total_blocks=16))
    descriptor = worker.adverts.get("d1").reach.descriptor
    key, block_addrs, rank_descriptor = rank1
    target = DecodeRankTarget(
        key, tuple(block_addrs), rank_descriptor or descriptor, 0 if bytes1 == bytes0 else bytes1
    )
    return PrefillJob(
        "tp",
        tuple(prompt),
        SamplingOptions(temperature=0.0),
        "d1",
        "Ltp",
        descriptor,
        rkey,
        tuple(addrs),
        bytes0,
        enqueued_at=0.0,
        ranks=(target,),
    )
