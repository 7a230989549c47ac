"""A prefill worker's writes of draft KV (docs/speculative.md): the prompt's KV for a draft
worker, best effort, never a job's failure. An early-exit draft worker takes the first layers of
the target's own blocks (``DraftKvPlanner``); a model draft worker takes whole blocks that a draft
model run beside the target computed (``--draft-model``: ``DraftBlockPlanner`` over the draft
engine's pool). A job's reservation is never waited for: taken with the first chunk after it
came, the chunks before it written then."""

from __future__ import annotations

import asyncio

from kvmesh.services.prefill.draft_kv import DraftBlockPlanner, DraftKvPlanner
from kvmesh.services.prefill.endpoints import EndpointCache
from kvmesh.services.prefill.job import STOP, DraftWrites, Job
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import ChunkWrite, PlanError
from kvmesh.shared.bus.protocol import DraftKvReserveReply, PrefillDone, PrefillJob
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import ChunkReady, RequestError
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport import MemoryRegion, TransportError, WriteEntry

log = logs.get_logger(__name__)


class DraftKv:
    def __init__(
        self,
        engine: LLMEngine,
        region: MemoryRegion,
        endpoints: EndpointCache,
        metrics: PrefillMetrics,
        lock: asyncio.Lock,
        draft_engine: LLMEngine | None,
        draft_region: MemoryRegion | None,
    ) -> None:
        """``engine``/``region``: the target's (an early exit's blocks come from its pool);
        ``lock``: the engines' (the worker's); ``draft_engine``: the draft model, its pool
        registered as ``draft_region`` (None: none here)."""
        self.engine = engine
        self.region = region
        self.endpoints = endpoints
        self.metrics = metrics
        self._lock = lock
        self.draft_engine = draft_engine
        self.draft_region = draft_region
        self.block_size = engine.kv_pool.spec.block_size
        self.block_bytes = engine.kv_pool.spec.block_bytes
        self.chunks: list[ChunkReady] = []  # the draft engine's, filled during its step()

    def on_chunk(self, chunk: ChunkReady) -> None:
        self.chunks.append(chunk)  # in the engine thread, during the draft engine's step()

    def add(self, request_id: str, prompt: list[int]) -> asyncio.Queue[ChunkReady | None] | None:
        """The prompt into the draft engine (under the engine lock); its chunks' queue, or None
        without a draft model or when the draft engine cannot take the prompt."""
        if self.draft_engine is None:
            return None
        params = SamplingOptions(max_tokens=1, temperature=0.0)
        try:
            self.draft_engine.add_request(
                request_id, prompt, params, prefill_only=True, on_chunk=self.on_chunk
            )
        except RequestError as exc:
            log.info("draft model not run", request_id=request_id, error=str(exc))
            return None
        return asyncio.Queue()

    async def model_writes(
        self,
        job: Job,
        reply: asyncio.Future[DraftKvReserveReply | None],
        tg: asyncio.TaskGroup,
    ) -> None:
        """The draft engine's chunks of ``job``'s prompt, written whole into a model draft
        worker's reserved blocks once its reservation came (taken with the first draft chunk
        after it; the chunks before it are written then). Any other answer (none, a refusal,
        an early exit's) ends the job's draft compute."""
        assert job.draft_chunks is not None and self.draft_engine is not None
        pending: asyncio.Future[DraftKvReserveReply | None] | None = reply
        blocks: list[int] = []  # the draft engine's blocks of the prompt so far
        while (chunk := await job.draft_chunks.get()) is not STOP:
            blocks += chunk.block_ids
            new_blocks = chunk.block_ids
            if pending is not None and pending.done():
                if not is_whole_blocks(pending):
                    break
                job.draft = await self.writes(job.msg, reply_of(pending))
                pending, new_blocks = None, tuple(blocks)
            self.plan_write(job, DraftBlockPlanner, new_blocks, tg)
            if chunk.is_last:
                return
        async with self._lock:  # stopped early: no draft write was issued
            self.draft_engine.abort(job.msg.request_id)

    async def drop_if_waiting(self, job: Job) -> None:
        """The target's last chunk is in: a draft prompt the draft engine has not admitted
        yet (its pool is full) is dropped rather than waited for."""
        if job.draft_chunks is None or self.draft_engine is None:
            return
        async with self._lock:
            seq = self.draft_engine.seqs.get(job.msg.request_id)
            if seq is None or seq.block_table:
                return
            self.draft_engine.abort(job.msg.request_id)
        log.info("draft model found no room", request_id=job.msg.request_id)
        job.draft_chunks.put_nowait(STOP)

    async def writes(
        self, msg: PrefillJob, reply: DraftKvReserveReply | None
    ) -> DraftWrites | None:
        """The draft writes of a job, if its reservation came and fits this worker."""
        if reply is None or not reply.ok or reply.descriptor is None:
            return None
        spec = self.engine.kv_pool.spec
        try:
            if reply.whole_blocks:  # a model draft worker's: from the draft engine's pool
                if self.draft_engine is None or self.draft_region is None:
                    raise PlanError("this prefill worker runs no draft model")
                planner: DraftKvPlanner | DraftBlockPlanner = DraftBlockPlanner(
                    reply,
                    len(msg.prompt_ids),
                    self.block_size,
                    self.draft_engine.kv_pool.spec.block_bytes,
                )
                region = self.draft_region
            else:  # an early exit's: the first layers of the target's blocks
                planner = DraftKvPlanner(
                    reply,
                    len(msg.prompt_ids),
                    self.block_size,
                    spec.num_layers,
                    spec.num_kv_heads,
                    self.block_bytes,
                )
                region = self.region
            endpoint = await self.endpoints.get(reply.descriptor)
        except (PlanError, TransportError, ValueError) as exc:
            log.info("draft kv not written", request_id=msg.request_id, error=str(exc))
            return DraftWrites(reply, error=str(exc))
        return DraftWrites(reply, planner, region, endpoint)

    def plan_write(
        self,
        job: Job,
        kind: type[DraftKvPlanner | DraftBlockPlanner],
        block_ids: tuple[int, ...],
        tg: asyncio.TaskGroup,
    ) -> None:
        """Plan the draft write of ``block_ids`` (the target's blocks for an early exit's
        reservation, the draft engine's for a model worker's: ``kind``) and issue it, unless
        the job's draft writes already failed."""
        draft = job.draft
        if draft is None or not isinstance(draft.planner, kind):
            return
        write = draft.planner.plan(block_ids)
        if write is not None and not draft.error:
            tg.create_task(self._write(draft, write))

    async def _write(self, draft: DraftWrites, write: ChunkWrite) -> None:
        assert draft.endpoint is not None and draft.reply.descriptor is not None
        assert draft.region is not None
        entries = [
            WriteEntry(draft.region, s.local_offset, s.remote_addr, draft.reply.rkey, s.length)
            for s in write.spans
        ]
        try:
            await draft.endpoint.write(entries, write.imm)
        except TransportError as exc:
            if not draft.error:
                draft.error = f"draft KV write {write.chunk_index} failed: {exc}"
                log.info("draft kv write failed", error=str(exc))
                await self.endpoints.forget(draft.reply.descriptor)
            return
        self.metrics.draft_kv_bytes.inc(write.num_bytes)
        draft.num_writes += 1

    @staticmethod
    def done_of(
        msg: PrefillJob, draft: DraftWrites, ok: bool, error: str
    ) -> tuple[str, PrefillDone]:
        """What the draft worker is told when the job ended (``ok``/``error``: the job's): its
        blocks wait for this (its lease id: the job's)."""
        draft_ok = ok and draft.is_complete
        draft_error = "" if draft_ok else (draft.error or error or "draft KV not complete")
        return (
            draft.reply.worker_id,
            PrefillDone(
                msg.request_id,
                msg.lease_id,
                draft_ok,
                num_writes=draft.num_writes,
                error=draft_error,
                rkey=draft.reply.rkey,
            ),
        )


def reply_of(future: asyncio.Future[DraftKvReserveReply | None]) -> DraftKvReserveReply | None:
    """A done reservation's reply (None: none came, or it was given up)."""
    return None if future.cancelled() else future.result()


def is_whole_blocks(future: asyncio.Future[DraftKvReserveReply | None]) -> bool:
    """Whether a done reservation is a model draft worker's (blocks of the draft model)."""
    reply = reply_of(future)
    return reply is not None and reply.ok and reply.whole_blocks
