"""A prefill job's KV writes: where they go (the decode worker's reserved blocks, rank by rank)
and one chunk's write to one of them.

A job writes every chunk into the decode worker's rank 0 and, for a tensor-parallel decode
worker, into its other ranks too (``RankTarget``), each through a ``ChunkPlanner`` of this
worker's share of the heads (kv_writes.py: ``RankSlice``). A decode worker that keeps its KV in
another dtype gets it converted first, into a mirror pool the writes read from (convert.py);
only a TP1 prefill worker writes to a TP1 decode worker that way. What cannot be planned is a
``PlanError`` that refuses the job. Each chunk goes to each rank in one batched write
(``write_chunk``), timed for the job's timeline and the metrics; the first that fails stops the
job (the worker's part).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvmesh.services.prefill.convert import KVMirror, KVMirrors, decode_kv_dtype
from kvmesh.services.prefill.job import Job, RankTarget
from kvmesh.services.prefill.kv_writes import RankSlice, job_rank_slices
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import ChunkPlanner, ChunkWrite, PlanError
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.engine.sequence import ChunkReady
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport import Endpoint, MemoryRegion, WriteEntry
from kvmesh.shared.transport.endpoint_cache import EndpointCache

if TYPE_CHECKING:
    from kvmesh.services.prefill.tp_group import TPWrites


@dataclass(frozen=True, slots=True)
class JobTargets:
    """A job's writes: rank 0's planner and endpoint (and the mirror its KV is converted into,
    for another KV dtype), and the decode worker's other ranks."""

    planner: ChunkPlanner
    endpoint: Endpoint
    mirror: KVMirror | None
    others: tuple[RankTarget, ...]


async def job_targets(
    msg: PrefillJob,
    advert: DecodeAdvert,
    spec: KVCacheSpec,
    kv_spec: str,
    mirrors: KVMirrors,
    endpoints: EndpointCache,
    tp: TPWrites | None,
) -> JobTargets:
    """The targets of ``msg``'s job, on the decode worker ``advert`` vouches for, from this
    worker's pool of ``spec`` (laid out as ``kv_spec``); ``tp``: this worker leads TP ranks.
    Raises PlanError (cannot write there) and TransportError (cannot reach it)."""
    dtype = decode_kv_dtype(kv_spec, advert.reach.kv_spec)  # None: the same KV dtype
    if dtype is not None and tp is not None:
        raise PlanError(
            f"the decode worker keeps its KV as {dtype}: a tensor-parallel prefill "
            f"worker writes only to decode workers of its own KV dtype"
        )
    if dtype is not None and msg.ranks:
        raise PlanError(
            f"the decode worker keeps its KV as {dtype} at TP {len(msg.ranks) + 1}: "
            f"tensor-parallel decode workers take only KV of their own dtype"
        )
    mirror = None if dtype is None else mirrors.get(dtype)
    slices = rank_slices(spec, tp, len(msg.ranks) + 1)
    planner = ChunkPlanner(
        len(msg.prompt_ids),
        spec.block_size,
        spec.block_bytes if mirror is None else mirror.spec.block_bytes,
        msg.block_addrs,
        msg.block_bytes,
        rank_slice=slices[0],
    )
    others = []
    for rank_slice in slices[1:]:
        rank = msg.ranks[rank_slice.dst_rank - 1]
        other = ChunkPlanner(
            len(msg.prompt_ids),
            spec.block_size,
            spec.block_bytes,
            rank.block_addrs,
            rank.block_bytes or msg.block_bytes,
            rank_slice=rank_slice,
        )
        rank_endpoint = await endpoints.get(rank.descriptor)
        others.append(RankTarget(other, rank_endpoint, rank.rkey, rank.descriptor))
    endpoint = await endpoints.get(msg.descriptor)
    return JobTargets(planner, endpoint, mirror, tuple(others))


def rank_slices(spec: KVCacheSpec, tp: TPWrites | None, decode_tp: int) -> list[RankSlice | None]:
    """What this worker writes of every block into each decode rank it writes to, decode
    rank 0 first; ``[None]`` (whole blocks) from TP1 to TP1."""
    if tp is not None:
        return list(tp.rank_slices(decode_tp))
    if decode_tp == 1:
        return [None]
    return list(job_rank_slices(spec, spec.num_kv_heads, 1, decode_tp))


async def write_chunk(
    job: Job,
    write: ChunkWrite,
    chunk: ChunkReady,
    rank: RankTarget | None,
    region: MemoryRegion,
    pool: KVPool,
    metrics: PrefillMetrics,
) -> None:
    """Write ``chunk``'s ``write`` from ``pool`` (registered as ``region``) to the decode
    worker's rank 0, or to its ``rank``: converted into the job's mirror first when the decode
    worker keeps another KV dtype. Raises TransportError."""
    msg = job.msg
    endpoint = job.endpoint if rank is None else rank.endpoint
    rkey = msg.rkey if rank is None else rank.rkey
    if job.mirror is not None:  # another KV dtype on the decode side: convert, then write
        region = job.mirror.region
        bs = pool.spec.block_size
        num_tokens = chunk.end_token - (-(-chunk.end_token // bs) - len(chunk.block_ids)) * bs
        await asyncio.to_thread(job.mirror.convert, pool, chunk.block_ids, num_tokens)
    entries = [
        WriteEntry(region, s.local_offset, s.remote_addr, rkey, s.length) for s in write.spans
    ]
    t0 = time.perf_counter()
    await endpoint.write(entries, write.imm)
    t1 = time.perf_counter()
    job.timeline.on_write(t0, t1)
    metrics.observe_write(sum(s.length for s in write.spans), t1 - t0)
    if rank is None:  # each decode rank counts as many (PrefillDone.num_writes: one rank's)
        job.num_writes += 1
