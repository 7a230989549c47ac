"""A follower rank of a tensor-parallel prefill worker (docs/tp.md).

The leader (rank 0) takes the jobs and drives its engine through ``LeaderEngine``; each job's
``add_request`` carries a ``HandOff`` note: where the KV goes. A follower replays the leader's
engine calls (``follow``, in a thread: the forward passes all-reduce with the leader's) and
writes its own heads of every chunk its engine reports straight into the decode worker's blocks
(``rank_block_slices``, ``ChunkPlanner``: no gather to rank 0), over its own transport, from its
own registered pool. The decode worker counts every rank's write of a chunk (the immediates
differ by writer); the leader announces them all (``ChunkPlanner.num_writes``).

Not yet: telling the leader that a follower's write failed (the decode's lease then expires,
its blocks quarantined, instead of failing at once).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec
import torch.distributed as dist
from kvmesh.services.prefill.kv_writes import rank_block_slices
from kvmesh.services.prefill.plan import ChunkPlanner, ChunkWrite, PlanError
from kvmesh.shared.engine.sequence import ChunkReady
from kvmesh.shared.engine.tp_leader import EngineCall, follow
from kvmesh.shared.kv.head_shards import KVHeadShards
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import (
    Endpoint,
    MemoryRegion,
    Transport,
    TransportDescriptor,
    TransportError,
    WriteEntry,
)

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
    ) -> None:
        self.engine = engine
        self.group = group
        self.rank = dist.get_rank(group)
        self.src = KVHeadShards(num_kv_heads, dist.get_world_size(group))
        self.transport = transport
        self.region = region
        self.stats = FollowerStats()
        self._endpoints: dict[bytes, Endpoint] = {}
        self._jobs: dict[str, list[tuple[ChunkPlanner, bytes, int]]] = {}

    async def run(self) -> FollowerStats:
        """Follow the leader until it closes; every chunk's writes done before returning."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[ChunkReady | None] = asyncio.Queue()

        def on_chunk(chunk: ChunkReady) -> None:  # in the engine thread
            loop.call_soon_threadsafe(chunks.put_nowait, chunk)

        def on_call(call: EngineCall) -> dict[str, Any]:
            if call.method != "add_request" or not isinstance(call.note, HandOff):
                return {}
            self._jobs[call.args[0]] = self._planners(call.note, len(call.args[1]))
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
                for planner, descriptor, rkey in self._jobs.get(chunk.request_id, ()):
                    try:
                        write = planner.plan(
                            chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last
                        )
                    except PlanError as exc:
                        log.error("tp follower plan failed", rank=self.rank, error=str(exc))
                        self.stats.num_failed += 1
                        continue
                    await self._write(descriptor, rkey, write)
                if chunk.is_last:
                    self._jobs.pop(chunk.request_id, None)
        for endpoint in self._endpoints.values():
            await endpoint.aclose()
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

    async def _write(self, descriptor: bytes, rkey: int, write: ChunkWrite) -> None:
        entries = [
            WriteEntry(self.region, s.local_offset, s.remote_addr, rkey, s.length)
            for s in write.spans
        ]
        try:
            endpoint = self._endpoints.get(descriptor)
            if endpoint is None:
                peer = msgspec.json.decode(descriptor, type=TransportDescriptor)
                endpoint = self._endpoints[descriptor] = await self.transport.connect(peer)
            await endpoint.write(entries, write.imm)
        except TransportError as exc:
            self.stats.num_failed += 1
            log.warning("tp follower write failed", rank=self.rank, error=str(exc))
            return
        self.stats.num_writes += 1
        self.stats.num_bytes += write.num_bytes
