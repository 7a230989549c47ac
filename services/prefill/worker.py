"""The prefill worker: runs prompts through the engine in chunks and writes each chunk's KV blocks
into the decode worker's reserved blocks while the next chunk computes.

One engine loop steps the engine (in a worker thread, under ``self._lock``) for every job in
flight; after each step the chunks it completed are handed to their jobs. Each job
(``prefill()``) issues one batched write per chunk as soon as the chunk is ready, so the write of
chunk i runs while the forward pass of chunk i+1 does. When the last write has landed the job
ends with ``PrefillDone(num_writes, first_token)`` for the decode worker and ``PrefillReport`` for
the router, and its local blocks are freed. An Abort stops the job between chunks; the decode
worker still gets a PrefillDone (ok=False) once no write is in flight, so its blocks return.

With a draft model (``draft_engine``, --draft-model) the loop steps a second engine after the
target's, over the prompts of jobs a model draft worker may take the draft KV of: the target's
chunk writes are issued first and run meanwhile, so a job pays the draft compute and nothing
else; the draft chunks' whole blocks go to the draft worker (docs/speculative.md).

The worker knows no NATS: the service (the shell) calls it and publishes what it returns
(``started()``, ``prefill()``'s ``PrefillResult``). It reaches decode workers' memory itself,
through the transport endpoints of its ``EndpointCache`` (the data plane is below it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvmesh.services.prefill.adverts import AdvertBook
from kvmesh.services.prefill.convert import KVMirror, KVMirrors, decode_kv_dtype
from kvmesh.services.prefill.draft_kv import DraftBlockPlanner, DraftKvPlanner
from kvmesh.services.prefill.endpoints import EndpointCache
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import (
    ChunkPlanner,
    ChunkWrite,
    PlanError,
    PrefillTimeline,
)
from kvmesh.services.prefill.store_prefix import StorePrefix
from kvmesh.shared import logs
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import ChunkReady, RequestError
from kvmesh.shared.protocol import (
    DraftKvReserveReply,
    PrefillDone,
    PrefillJob,
    PrefillReport,
    PrefillStarted,
)
from kvmesh.shared.sampling import SamplingOptions, TokenLogprobs
from kvmesh.shared.transport import Endpoint, MemoryRegion, TransportError, WriteEntry

log = logs.get_logger(__name__)

_STOP = None  # queue marker: the job was aborted or failed; no more chunks come


@dataclass(eq=False)
class _Job:
    msg: PrefillJob
    planner: ChunkPlanner
    timeline: PrefillTimeline
    endpoint: Endpoint
    mirror: KVMirror | None = None  # the decode's KV dtype differs: written from this mirror
    chunks: asyncio.Queue[ChunkReady | None] = field(default_factory=asyncio.Queue)
    num_writes: int = 0
    first_token: int = -1
    first_logprobs: TokenLogprobs | None = None  # with SamplingOptions.logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # with SamplingOptions.prompt_logprobs
    error: str = ""
    is_computed: bool = False  # the last chunk is in; the engine holds the blocks until release
    draft: _DraftWrites | None = None  # the prompt's draft KV to a draft worker
    # the draft engine's chunks of the prompt (with a draft model; None: not run for this job)
    draft_chunks: asyncio.Queue[ChunkReady | None] | None = None


@dataclass(eq=False)
class _DraftWrites:
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


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """How a job ended: ``done`` goes to its decode worker (always), ``report`` to its router
    (None for a job refused before it started)."""

    done: PrefillDone
    report: PrefillReport | None = None
    # (draft worker id, its announcement) when a draft worker reserved blocks for the prompt's
    # draft KV: sent before ``done``, so the draft worker has the KV when the decode's first
    # context arrives
    draft_done: tuple[str, PrefillDone] | None = None


class PrefillWorker:
    def __init__(
        self,
        engine: LLMEngine,
        region: MemoryRegion,
        endpoints: EndpointCache,
        *,
        worker_id: str,
        kv_spec: str,
        abort_memory_s: float = 60.0,
        advert_wait_s: float = 3.0,
        metrics: PrefillMetrics | None = None,
        store: StorePrefix | None = None,
        draft_engine: LLMEngine | None = None,
        draft_region: MemoryRegion | None = None,
    ) -> None:
        """``draft_engine``: the draft model run beside the target (--draft-model), its pool
        registered as ``draft_region``."""
        assert (draft_engine is None) == (draft_region is None)
        self.engine = engine
        self.draft_engine = draft_engine
        self.draft_region = draft_region
        # what a model draft worker checks a reservation against ("": no draft model here)
        self.draft_kv_spec = draft_engine.kv_spec if draft_engine is not None else ""
        self.store = store  # a kv-store's prefixes (read before, written after a job), if any
        self.metrics = metrics or PrefillMetrics()
        self.region = region  # the engine's KV pool, registered as the source of writes
        self.endpoints = endpoints  # decode workers' memory, reached over the transport
        self.worker_id = worker_id
        self.kv_spec = kv_spec
        self.block_size = engine.kv_pool.spec.block_size
        self.block_bytes = engine.kv_pool.spec.block_bytes
        self.adverts = AdvertBook(kv_spec)  # the only targets this worker writes to
        self.mirrors = KVMirrors(engine.kv_pool, endpoints)  # for decode workers of other KV dtypes
        self._advert_wait_s = advert_wait_s
        self._abort_memory_s = abort_memory_s
        self._jobs: dict[str, _Job] = {}
        self._aborted: dict[str, float] = {}  # request id -> monotonic time of its Abort
        self._chunks: list[ChunkReady] = []  # filled by on_chunk in the engine thread
        self._draft_chunks: list[ChunkReady] = []  # the draft engine's, likewise
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self.metrics.jobs_running.set_function(lambda: len(self._jobs))

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    # ---- the engine loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine while any job computes; hand each finished chunk to its job. With a
        draft model, step its engine after each target step (the target chunks' writes run
        meanwhile) and hand its chunks over likewise."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                async with self._lock:
                    is_busy = self.engine.has_unfinished()
                    draft = self.draft_engine
                    if not is_busy and (draft is None or not draft.has_unfinished()):
                        break
                    chunks = await self._step_target() if is_busy else []
                self._hand_out(chunks)
                if draft is not None:
                    async with self._lock:
                        chunks = await self._step_draft(draft) if draft.has_unfinished() else []
                    self._hand_out_draft(chunks)

    async def _step_target(self) -> list[ChunkReady]:
        t0 = time.perf_counter()
        hits = self.engine.block_manager.num_hit_tokens
        await asyncio.to_thread(self.engine.step)
        t1 = time.perf_counter()
        self.metrics.observe_chunk(t1 - t0)
        self.metrics.prefix_hit_tokens.inc(self.engine.block_manager.num_hit_tokens - hits)
        chunks, self._chunks = self._chunks, []
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None:
                job.timeline.on_forward(t1 - t0)
                if chunk.is_last:
                    job.is_computed = True
                    job.timeline.on_compute_done(t1)
        return chunks

    async def _step_draft(self, draft: LLMEngine) -> list[ChunkReady]:
        t0 = time.perf_counter()
        await asyncio.to_thread(draft.step)
        self.metrics.draft_compute.observe(time.perf_counter() - t0)
        chunks, self._draft_chunks = self._draft_chunks, []
        return chunks

    def _hand_out(self, chunks: list[ChunkReady]) -> None:
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None:
                job.chunks.put_nowait(chunk)

    def _hand_out_draft(self, chunks: list[ChunkReady]) -> None:
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None and job.draft_chunks is not None:
                job.draft_chunks.put_nowait(chunk)

    def _on_chunk(self, chunk: ChunkReady) -> None:
        self._chunks.append(chunk)  # in the engine thread, during step(), under self._lock

    def _on_draft_chunk(self, chunk: ChunkReady) -> None:
        self._draft_chunks.append(chunk)  # likewise, during the draft engine's step()

    # ---- jobs ---------------------------------------------------------------------------------

    def started(self, msg: PrefillJob) -> PrefillStarted:
        """What tells the router and the decode worker that this worker took ``msg``'s job: from
        then on they count on it (and on hearing if it dies)."""
        return PrefillStarted(msg.request_id, msg.lease_id, self.worker_id)

    async def prefill(
        self, msg: PrefillJob, draft: asyncio.Future[DraftKvReserveReply | None] | None = None
    ) -> PrefillResult | None:
        """Run one job to its end: every write landed (or none in flight). Returns what to tell
        the decode worker and the router; None for a duplicate of a job in hand. ``draft``: a
        draft worker's reservation for the prompt's draft KV, never waited for: taken with the
        first chunk after it came (the chunks before it are written then too); not come by the
        last chunk, or None, or a refusal: no draft writes. With a draft model the draft
        engine computes the prompt too, for a model draft worker's reservation (whole blocks,
        from the draft engine's chunks); any other answer ends that compute."""
        rid = msg.request_id
        started_at = time.time()
        if rid in self._jobs:
            log.warning("ignored a duplicate prefill job", request_id=rid)
            return None
        if self._aborted.pop(rid, None) is not None:
            return self._result(msg, None, f"aborted before prefill started on {self.worker_id}")
        try:
            advert = await self.adverts.vouch(msg, self._advert_wait_s)
            dtype = decode_kv_dtype(self.kv_spec, advert.kv_spec)  # None: the same KV dtype
            mirror = None if dtype is None else self.mirrors.get(dtype)
            planner = ChunkPlanner(
                len(msg.prompt_ids),
                self.block_size,
                self.block_bytes if mirror is None else mirror.spec.block_bytes,
                msg.block_addrs,
                msg.block_bytes,
            )
            params = msg.sampling
            endpoint = await self.endpoints.get(msg.descriptor)
        except (PlanError, TransportError, ValueError) as exc:
            log.warning("prefill job refused", request_id=rid, error=str(exc))
            return self._result(msg, None, str(exc))
        job = _Job(msg, planner, PrefillTimeline(msg.enqueued_at, started_at), endpoint, mirror)
        self._jobs[rid] = job
        prompt = list(msg.prompt_ids)
        fetched = await self.store.fetch(prompt, self._lock) if self.store is not None else None
        try:
            async with self._lock:
                if fetched is not None:  # adopted and added at once: nothing evicts it between
                    self.metrics.store_hit_tokens.inc(self.store.adopt(fetched))
                self.metrics.prompt_tokens.inc(len(prompt))
                self.engine.add_request(
                    rid,
                    list(msg.prompt_ids),
                    params,
                    prefill_only=True,
                    on_chunk=self._on_chunk,
                )
                if draft is not None:
                    job.draft_chunks = self._add_draft(rid, prompt)
        except RequestError as exc:
            del self._jobs[rid]
            return self._result(msg, None, str(exc))
        self._wake.set()
        try:
            async with asyncio.TaskGroup() as tg:
                if job.draft_chunks is not None:
                    assert draft is not None
                    tg.create_task(self._draft_model_writes(job, draft, tg))
                blocks: list[int] = []  # the job's local blocks so far (the engine holds them)
                while (chunk := await job.chunks.get()) is not _STOP:
                    write = planner.plan(
                        chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last
                    )
                    tg.create_task(self._write(job, write, chunk))
                    blocks += chunk.block_ids
                    new_blocks = chunk.block_ids
                    # an early exit's reservation: the chunks so far, then each (a model
                    # worker's is _draft_model_writes')
                    if draft is not None and draft.done() and not _is_whole_blocks(draft):
                        job.draft = await self._draft_writes(msg, _reply(draft))
                        draft, new_blocks = None, tuple(blocks)
                    self._plan_draft_write(job, DraftKvPlanner, new_blocks, tg)
                    if chunk.is_last:
                        job.first_token = chunk.first_token
                        job.first_logprobs = chunk.first_logprobs
                        job.prompt_logprobs = chunk.prompt_logprobs
                        await self._drop_draft_if_waiting(job)
                        break
            # every write has returned: no byte of ours is still on its way to the decode blocks
        except PlanError as exc:  # an engine/plan disagreement: a bug, but never leak blocks
            job.error = f"internal error planning KV writes: {exc}"
            log.error("plan failed", request_id=rid, error=str(exc))
        finally:
            del self._jobs[rid]
            async with self._lock:
                self.engine.abort(rid)  # frees the local blocks, computed or not
                if job.draft_chunks is not None and self.draft_engine is not None:
                    self.draft_engine.abort(rid)
            self._wake.set()
        if self.store is not None and job.is_computed and not job.error:
            self.store.put_later(prompt, self._lock)  # its full blocks stay cached meanwhile
        return self._result(msg, job, job.error)

    async def _write(self, job: _Job, write: ChunkWrite, chunk: ChunkReady) -> None:
        msg = job.msg
        region = self.region
        if job.mirror is not None:  # another KV dtype on the decode side: convert, then write
            region = job.mirror.region
            bs = self.block_size
            num_tokens = chunk.end_token - (-(-chunk.end_token // bs) - len(chunk.block_ids)) * bs
            pool = self.engine.kv_pool
            await asyncio.to_thread(job.mirror.convert, pool, chunk.block_ids, num_tokens)
        entries = [
            WriteEntry(region, s.local_offset, s.remote_addr, msg.rkey, s.length)
            for s in write.spans
        ]
        t0 = time.perf_counter()
        try:
            await job.endpoint.write(entries, write.imm)
        except TransportError as exc:
            if not job.error:
                job.error = (
                    f"KV write of chunk {write.chunk_index} to {msg.decode_worker_id} failed: {exc}"
                )
                log.warning("kv write failed", request_id=msg.request_id, error=str(exc))
                await self.endpoints.forget(msg.descriptor)
                await self._stop(job)
            return
        t1 = time.perf_counter()
        job.timeline.on_write(t0, t1)
        self.metrics.observe_write(sum(s.length for s in write.spans), t1 - t0)
        job.num_writes += 1

    def _add_draft(
        self, request_id: str, prompt: list[int]
    ) -> asyncio.Queue[ChunkReady | None] | None:
        """The prompt into the draft engine (under ``self._lock``); its chunks' queue, or None
        without a draft model or when the draft engine cannot take the prompt."""
        if self.draft_engine is None:
            return None
        params = SamplingOptions(max_tokens=1, temperature=0.0)
        try:
            self.draft_engine.add_request(
                request_id, prompt, params, prefill_only=True, on_chunk=self._on_draft_chunk
            )
        except RequestError as exc:
            log.info("draft model not run", request_id=request_id, error=str(exc))
            return None
        return asyncio.Queue()

    async def _draft_model_writes(
        self,
        job: _Job,
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
        while (chunk := await job.draft_chunks.get()) is not _STOP:
            blocks += chunk.block_ids
            new_blocks = chunk.block_ids
            if pending is not None and pending.done():
                if not _is_whole_blocks(pending):
                    break
                job.draft = await self._draft_writes(job.msg, _reply(pending))
                pending, new_blocks = None, tuple(blocks)
            self._plan_draft_write(job, DraftBlockPlanner, new_blocks, tg)
            if chunk.is_last:
                return
        async with self._lock:  # stopped early: no draft write was issued
            self.draft_engine.abort(job.msg.request_id)

    async def _drop_draft_if_waiting(self, job: _Job) -> None:
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
        job.draft_chunks.put_nowait(_STOP)

    async def _draft_writes(
        self, msg: PrefillJob, reply: DraftKvReserveReply | None
    ) -> _DraftWrites | None:
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
            return _DraftWrites(reply, error=str(exc))
        return _DraftWrites(reply, planner, region, endpoint)

    def _plan_draft_write(
        self,
        job: _Job,
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
            tg.create_task(self._write_draft(draft, write))

    async def _write_draft(self, draft: _DraftWrites, write: ChunkWrite) -> None:
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

    async def _stop(self, job: _Job) -> None:
        """No more chunks for this job: the engines drop it, its queues get the stop marker."""
        if not job.is_computed:
            async with self._lock:
                self.engine.abort(job.msg.request_id)
        job.chunks.put_nowait(_STOP)
        if job.draft_chunks is not None and self.draft_engine is not None:
            async with self._lock:
                self.draft_engine.abort(job.msg.request_id)
            job.draft_chunks.put_nowait(_STOP)

    async def abort(self, request_id: str, reason: str) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            now = time.monotonic()
            self._aborted = {
                r: t for r, t in self._aborted.items() if now - t < self._abort_memory_s
            }
            self._aborted[request_id] = now
            return
        if not job.error:
            job.error = f"aborted: {reason}"
            await self._stop(job)

    def _result(self, msg: PrefillJob, job: _Job | None, error: str) -> PrefillResult:
        ok = job is not None and not error
        draft = job.draft if job is not None else None
        draft_done = None
        if draft is not None:  # the draft worker's blocks wait for this (its lease id: the job's)
            draft_ok = ok and draft.is_complete
            draft_error = "" if draft_ok else (draft.error or error or "draft KV not complete")
            draft_done = (
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
        done = PrefillDone(
            msg.request_id,
            msg.lease_id,
            ok,
            first_token=job.first_token if ok else -1,
            first_logprobs=job.first_logprobs if ok else None,
            prompt_logprobs=job.prompt_logprobs if ok else (),
            num_writes=job.num_writes if job is not None else 0,
            error=error,
            rkey=msg.rkey,
            draft_worker_id=draft_done[0] if draft_done and draft_done[1].ok else "",
        )
        if job is None:
            self.metrics.observe_job(None, ok=False)
            return PrefillResult(done)
        t = job.timeline.timing()
        self.metrics.observe_job(t, ok=ok)
        log.debug("prefill done", request_id=msg.request_id, ok=ok, error=error, timing=t)
        report = PrefillReport(
            msg.request_id,
            self.worker_id,
            queue_s=t.queue_s,
            compute_s=t.compute_s,
            transfer_s=t.transfer_s,
            exposed_transfer_s=t.exposed_transfer_s,
            num_chunks=t.num_chunks,
        )
        return PrefillResult(done, report, draft_done)


def _reply(future: asyncio.Future[DraftKvReserveReply | None]) -> DraftKvReserveReply | None:
    """A done reservation's reply (None: none came, or it was given up)."""
    return None if future.cancelled() else future.result()


def _is_whole_blocks(future: asyncio.Future[DraftKvReserveReply | None]) -> bool:
    """Whether a done reservation is a model draft worker's (blocks of the draft model)."""
    reply = _reply(future)
    return reply is not None and reply.ok and reply.whole_blocks
