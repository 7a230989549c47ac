"""A prefill worker's writes of draft KV (docs/speculative.md), a ``JobHook`` (job_hooks.py): the
prompt's KV for a draft worker, best effort, never a job's failure. An early-exit draft worker
takes the first layers of the target's own blocks (``DraftKvPlanner``); a model draft worker
takes whole blocks that a draft model run beside the target computed (``--draft-model``:
``DraftBlockPlanner`` over the draft engine's pool, stepped after each target step). A job's
reservation (asked for when the job arrives, draft_reserve.py; ``expect``) is never waited for:
taken with the first chunk after it came, the chunks before it written then; one the job wrote
nothing into is given back when the job ends."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.services.prefill.draft_kv import DraftBlockPlanner, DraftKvPlanner
from kvmesh.services.prefill.draft_reserve import DraftReservations, Reservation
from kvmesh.services.prefill.job import STOP, Job
from kvmesh.services.prefill.job_hooks import Announcement, JobHook
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import ChunkWrite, PlanError
from kvmesh.shared.bus.messages.drafts import DraftKvReserveReply
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import ChunkReady, RequestError
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport import Endpoint, MemoryRegion, TransportError, WriteEntry
from kvmesh.shared.transport.endpoint_cache import EndpointCache

if TYPE_CHECKING:
    from kvmesh.services.prefill.compose import PrefillParts

log = logs.get_logger(__name__)


@dataclass(eq=False)
class DraftWrites:
    """A job's writes of draft KV (docs/speculative.md): best effort, never the job's failure."""

    reply: DraftKvReserveReply
    # None: the reply did not fit (``error`` says why)
    planner: DraftKvPlanner | DraftBlockPlanner | None = None
    region: MemoryRegion | None = None  # written from: the target's pool or the draft engine's
    endpoint: Endpoint | None = None
    num_writes: int = 0
    error: str = ""

    @property
    def is_complete(self) -> bool:
        """Every planned write landed: the draft worker holds the prompt's full blocks."""
        return (
            self.planner is not None
            and self.planner.is_complete
            and not self.error
            and self.num_writes == self.planner.num_writes_planned
        )


@dataclass(eq=False)
class DraftJob:
    """What the hook keeps of one job: its reservation, the draft engine's chunks of its prompt
    (None: the draft model does not run it) and its writes once the reservation was taken."""

    reservation: Reservation
    chunks: asyncio.Queue[ChunkReady | None] | None = None
    writes: DraftWrites | None = None
    early_taken: bool = False  # an early exit's reservation taken by the target's chunks
    blocks: list[int] = field(default_factory=list)  # the target's blocks of the job so far


class DraftKv(JobHook):
    def __init__(
        self,
        engine: LLMEngine,
        region: MemoryRegion,
        endpoints: EndpointCache,
        metrics: PrefillMetrics,
        lock: asyncio.Lock,
        draft_engine: LLMEngine | None,
        draft_region: MemoryRegion | None,
        reservations: DraftReservations | None = None,
    ) -> None:
        """``engine``/``region``: the target's (an early exit's blocks come from its pool);
        ``lock``: the engines' (the worker's); ``draft_engine``: the draft model, its pool
        registered as ``draft_region`` (None: none here); ``reservations``: asks the draft
        workers for each arriving job's blocks (None: the caller hands them in, ``expect``)."""
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
        # what a model draft worker checks a reservation against ("": no draft model here)
        self.draft_kv_spec = draft_engine.kv_spec if draft_engine is not None else ""
        self._expected: dict[str, Reservation] = {}  # by request id, until the job is admitted
        self._jobs: dict[str, DraftJob] = {}
        self.reservations = reservations

    @classmethod
    def compose(cls, parts: PrefillParts) -> DraftKv | None:
        """``--draft-kv``: each prompt's draft KV written into a draft worker."""
        if not parts.config.draft_kv:
            return None
        draft_kv_spec = parts.draft_engine.kv_spec if parts.draft_engine is not None else ""
        return cls(
            parts.engine,
            parts.region,
            parts.endpoints,
            parts.metrics,
            parts.lock,
            parts.draft_engine,
            parts.draft_region,
            DraftReservations(parts.nc, parts.config.subjects, parts.kv_spec, draft_kv_spec),
        )

    def expect(self, msg: PrefillJob, reservation: Reservation) -> bool:
        """The draft worker's reservation for ``msg``'s prompt, asked for by the service before
        the job runs. False (not kept: the caller releases it) for a request id already
        expected or running."""
        rid = msg.request_id
        if rid in self._expected or rid in self._jobs:
            return False
        self._expected[rid] = reservation
        return True

    # ---- JobHook -------------------------------------------------------------------------------

    def on_received(self, msg: PrefillJob) -> None:
        """Ask for a draft worker's blocks for a prompt of at least one full block."""
        if self.reservations is not None and len(msg.prompt_ids) >= self.block_size:
            reservation = self.reservations.ask(msg)
            if not self.expect(msg, reservation):
                self.reservations.release(msg, reservation)

    def admit(self, job: Job, prompt: list[int]) -> None:
        reservation = self._expected.pop(job.msg.request_id, None)
        if reservation is not None:
            self._jobs[job.msg.request_id] = DraftJob(
                reservation, self._add(job.msg.request_id, prompt)
            )

    def has_work(self) -> bool:
        return self.draft_engine is not None and self.draft_engine.has_unfinished()

    async def step(self) -> None:
        """One draft engine step (after the target's: its chunk writes run meanwhile); its
        chunks to their jobs."""
        draft = self.draft_engine
        if draft is None:
            return
        async with self._lock:
            if not draft.has_unfinished():
                return
            t0 = time.perf_counter()
            await asyncio.to_thread(draft.step)
            self.metrics.draft_compute.observe(time.perf_counter() - t0)
            chunks, self.chunks = self.chunks, []
        for chunk in chunks:
            dj = self._jobs.get(chunk.request_id)
            if dj is not None and dj.chunks is not None:
                dj.chunks.put_nowait(chunk)

    def start(self, job: Job, tg: asyncio.TaskGroup) -> None:
        dj = self._jobs.get(job.msg.request_id)
        if dj is not None and dj.chunks is not None:
            tg.create_task(self._model_writes(job, dj, tg))

    async def on_chunk(self, job: Job, chunk: ChunkReady, tg: asyncio.TaskGroup) -> None:
        """An early exit's reservation: the target's chunks so far, then each (a model
        worker's is ``_model_writes``')."""
        dj = self._jobs.get(job.msg.request_id)
        if dj is None:
            return
        dj.blocks += chunk.block_ids
        new_blocks = chunk.block_ids
        pending = dj.reservation
        if not dj.early_taken and pending.done() and not is_whole_blocks(pending):
            dj.early_taken = True
            dj.writes = await self.writes(job.msg, reply_of(pending))
            new_blocks = tuple(dj.blocks)
        self._plan_write(dj, DraftKvPlanner, new_blocks, tg)

    async def on_computed(self, job: Job) -> None:
        """The target's last chunk is in: a draft prompt the draft engine has not admitted
        yet (its pool is full) is dropped rather than waited for."""
        dj = self._jobs.get(job.msg.request_id)
        if dj is None or dj.chunks is None or self.draft_engine is None:
            return
        async with self._lock:
            seq = self.draft_engine.seqs.get(job.msg.request_id)
            if seq is None or seq.block_table:
                return
            self.draft_engine.abort(job.msg.request_id)
        log.info("draft model found no room", request_id=job.msg.request_id)
        dj.chunks.put_nowait(STOP)

    async def on_stop(self, job: Job) -> None:
        dj = self._jobs.get(job.msg.request_id)
        if dj is not None and dj.chunks is not None and self.draft_engine is not None:
            async with self._lock:
                self.draft_engine.abort(job.msg.request_id)
            dj.chunks.put_nowait(STOP)

    def on_end(self, job: Job) -> None:
        dj = self._jobs.get(job.msg.request_id)
        if dj is not None and dj.chunks is not None and self.draft_engine is not None:
            self.draft_engine.abort(job.msg.request_id)  # under the worker's engine lock

    def finish(self, msg: PrefillJob, job: Job | None, ok: bool, error: str) -> Announcement | None:
        """What the draft worker is told when the job ended (``ok``/``error``: the job's): its
        blocks wait for this (its lease id: the job's). None when nothing was written there: the
        reservation is then given back."""
        expected = self._expected.pop(msg.request_id, None)
        dj = self._jobs.pop(msg.request_id, None) if job is not None else None
        if dj is None or dj.writes is None:
            reservation = dj.reservation if dj is not None else expected
            if reservation is not None and self.reservations is not None:
                self.reservations.release(msg, reservation)
            return None
        draft = dj.writes
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

    async def aclose(self) -> None:
        if self.reservations is not None:
            await self.reservations.aclose()

    # ---- the writes ----------------------------------------------------------------------------

    def on_draft_chunk(self, chunk: ChunkReady) -> None:
        self.chunks.append(chunk)  # in the engine thread, during the draft engine's step()

    def _add(self, request_id: str, prompt: list[int]) -> asyncio.Queue[ChunkReady | None] | None:
        """The prompt into the draft engine (under the engine lock); its chunks' queue, or None
        without a draft model or when the draft engine cannot take the prompt."""
        if self.draft_engine is None:
            return None
        params = SamplingOptions(max_tokens=1, temperature=0.0)
        try:
            self.draft_engine.add_request(
                request_id, prompt, params, prefill_only=True, on_chunk=self.on_draft_chunk
            )
        except RequestError as exc:
            log.info("draft model not run", request_id=request_id, error=str(exc))
            return None
        return asyncio.Queue()

    async def _model_writes(self, job: Job, dj: DraftJob, tg: asyncio.TaskGroup) -> None:
        """The draft engine's chunks of ``job``'s prompt, written whole into a model draft
        worker's reserved blocks once its reservation came (taken with the first draft chunk
        after it; the chunks before it are written then). Any other answer (none, a refusal,
        an early exit's) ends the job's draft compute."""
        assert dj.chunks is not None and self.draft_engine is not None
        pending: Reservation | None = dj.reservation
        blocks: list[int] = []  # the draft engine's blocks of the prompt so far
        while (chunk := await dj.chunks.get()) is not STOP:
            blocks += chunk.block_ids
            new_blocks = chunk.block_ids
            if pending is not None and pending.done():
                if not is_whole_blocks(pending):
                    break
                dj.writes = await self.writes(job.msg, reply_of(pending))
                pending, new_blocks = None, tuple(blocks)
            self._plan_write(dj, DraftBlockPlanner, new_blocks, tg)
            if chunk.is_last:
                return
        async with self._lock:  # stopped early: no draft write was issued
            self.draft_engine.abort(job.msg.request_id)

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

    def _plan_write(
        self,
        dj: DraftJob,
        kind: type[DraftKvPlanner | DraftBlockPlanner],
        block_ids: tuple[int, ...],
        tg: asyncio.TaskGroup,
    ) -> None:
        """Plan the draft write of ``block_ids`` (the target's blocks for an early exit's
        reservation, the draft engine's for a model worker's: ``kind``) and issue it, unless
        the job's draft writes already failed."""
        draft = dj.writes
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


def reply_of(future: asyncio.Future[DraftKvReserveReply | None]) -> DraftKvReserveReply | None:
    """A done reservation's reply (None: none came, or it was given up)."""
    return None if future.cancelled() else future.result()


def is_whole_blocks(future: asyncio.Future[DraftKvReserveReply | None]) -> bool:
    """Whether a done reservation is a model draft worker's (blocks of the draft model)."""
    reply = reply_of(future)
    return reply is not None and reply.ok and reply.whole_blocks
