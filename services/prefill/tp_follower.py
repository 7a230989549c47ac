"""A follower rank of a tensor-parallel prefill worker (docs/tp.md).

The leader (rank 0) takes the jobs and drives its engine through ``LeaderEngine``; each job's
``add_request`` carries a ``HandOff`` note: where the KV goes. A follower replays the leader's
engine calls (``follow``, in a thread: the forward passes all-reduce with the leader's) and
writes its own heads of every chunk its engine reports straight into the decode worker's blocks
(``rank_block_slices``, ``ChunkPlanner``: no gather to rank 0), over its own transport, from its
own registered pool. The decode worker counts every rank's write of a chunk (the immediates
differ by writer); the leader announces them all (``ChunkPlanner.num_writes``).

Each follower reports every job to the leader (``RankReport``, through ``report``): once all its
writes of the job have landed, or at its first failed write (it then writes no more of the job).
The leader announces a job only once every follower has reported it (``RankReports``), and fails
it on any follower's error: no job is announced with a write missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch.distributed as dist
from kvmesh.services.prefill.kv_writes import rank_block_slices
from kvmesh.services.prefill.plan import ChunkPlanner, PlanError
from kvmesh.shared.engine.sequence import ChunkReady
from kvmesh.shared.engine.tp_leader import EngineCall, follow
from kvmesh.shared.kv.head_shards import KVHeadShards
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import (
    MemoryRegion,
    Transport,
    TransportDescriptor,
    TransportError,
    WriteEntry,
)
from kvmesh.shared.transport.endpoint_cache import EndpointCache

log = logs.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """One decode rank's blocks for a job: its transport descriptor (JSON, as over NATS), the
    key of its window, its reserved blocks' addresses and its block size in bytes."""

    descriptor: bytes
    rkey: int
    block_addrs: tuple[int, ...]
    block_bytes: int


@dataclass(frozen=True, slots=True)
class HandOff:
    """Where a prefill job's KV goes, as every TP rank needs it (the note of its
    ``add_request``): one ``DecodeTarget`` per decode rank, in rank order (one for a decode
    worker at TP1, the mesh's only kind today)."""

    targets: tuple[DecodeTarget, ...]


@dataclass(frozen=True, slots=True)
class RankReport:
    """Follower -> leader: all of rank ``rank``'s writes of a job landed (``error`` empty), or
    one failed (``error`` says which)."""

    rank: int
    request_id: str
    error: str = ""


@dataclass(slots=True)
class _Job:
    planners: list[tuple[ChunkPlanner, bytes, int]]
    error: str = ""


@dataclass(slots=True)
class FollowerStats:
    num_calls: int = 0
    num_writes: int = 0
    num_bytes: int = 0
    num_failed: int = 0


class PrefillFollower:
    """One follower rank: its engine (sharded, pool registered as ``region`` with
    ``transport``), its rank in the TP ``group`` and the model's KV head count."""

    def __init__(
        self,
        engine: Any,
        group: dist.ProcessGroup | None,
        transport: Transport,
        region: MemoryRegion,
        num_kv_heads: int,
        report: Callable[[RankReport], None] | None = None,
    ) -> None:
        """``report``: how this rank tells the leader a job's writes are done (None: it does
        not; a test of the writes alone)."""
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.src = KVHeadShards(num_kv_heads, dist.get_world_size(group))
        self.transport = transport
        self.region = region
        self.stats = FollowerStats()
        self._endpoints = EndpointCache(transport)
        self._jobs: dict[str, _Job] = {}
        self._report = report

    async def run(self) -> FollowerStats:
        """Follow the leader until it closes; every chunk's writes done before returning."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[ChunkReady | None] = asyncio.Queue()

        def on_chunk(chunk: ChunkReady) -> None:  # in the engine thread
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        def on_call(call: EngineCall) -> dict[str, Any]:  # in the engine thread
            if call.method == "abort":  # the leader dropped it: no more chunks will come
                loop.call_soon_threadsafe(self._jobs.pop, call.args[0], None)
            if call.method != "add_request" or not isinstance(call.note, HandOff):
                return {}
            planners = self._planners(call.note, len(call.args[1]))
            loop.call_soon_threadsafe(self._jobs.__setitem__, call.args[0], _Job(planners))
            return {"on_chunk": on_chunk}

        async def replay() -> None:
            try:
                self.stats.num_calls = await asyncio.to_thread(
                    follow, self.engine, self.group, on_call
                )
            finally:
                chunks.put_nowait(None)

        async with asyncio.TaskGroup() as tg:
            tg.create_task(replay())
            while (chunk := await chunks.get()) is not None:
                job = self._jobs.get(chunk.request_id)
                if job is None:
                    continue
                for planner, descriptor, rkey in job.planners:
                    if job.error:
                        break
                    job.error = await self._write_chunk(planner, descriptor, rkey, chunk)
                    if job.error:
                        self.stats.num_failed += 1
                        self._tell(chunk.request_id, job.error)
                if chunk.is_last:
                    self._jobs.pop(chunk.request_id, None)
                    if not job.error:
                        self._tell(chunk.request_id, "")
        await self._endpoints.aclose()
        return self.stats

    def _planners(
        self, hand_off: HandOff, num_tokens: int
    ) -> list[tuple[ChunkPlanner, bytes, int]]:
        spec = self.engine.kv_pool.spec
        dst = KVHeadShards(self.src.num_kv_heads, len(hand_off.targets))
        planners = []
        for rank_slice in rank_block_slices(spec, self.src, dst, self.rank):
            target = hand_off.targets[rank_slice.dst_rank]
            planner = ChunkPlanner(
                num_tokens,
                spec.block_size,
                spec.block_bytes,
                target.block_addrs,
                target.block_bytes,
                rank_slice,
            )
            planners.append((planner, target.descriptor, target.rkey))
        return planners

    def _tell(self, request_id: str, error: str) -> None:
        if self._report is not None:
            self._report(RankReport(self.rank, request_id, error))

    async def _write_chunk(
        self, planner: ChunkPlanner, descriptor: bytes, rkey: int, chunk: ChunkReady
    ) -> str:
        """Plan and write this rank's share of ``chunk`` to one decode rank; the error, or ""."""
        try:
            write = planner.plan(chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last)
        except PlanError as exc:
            log.error("tp follower plan failed", rank=self.rank, error=str(exc))
            return f"rank {self.rank} could not plan chunk {chunk.chunk_index}: {exc}"
        entries = [
            WriteEntry(self.region, s.local_offset, s.remote_addr, rkey, s.length)
            for s in write.spans
        ]
        try:
            peer = msgspec.json.decode(descriptor, type=TransportDescriptor)
            endpoint = await self._endpoints.get(peer)
            await endpoint.write(entries, write.imm)
        except TransportError as exc:
            log.warning("tp follower write failed", rank=self.rank, error=str(exc))
            return f"rank {self.rank}'s KV write of chunk {chunk.chunk_index} failed: {exc}"
        self.stats.num_writes += 1
        self.stats.num_bytes += write.num_bytes
        return ""
