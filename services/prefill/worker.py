"""The prefill worker: runs prompts through the engine in chunks and writes each chunk's KV blocks
into the decode worker's reserved blocks while the next chunk computes.

One engine loop steps the engine (in a worker thread, under ``self._lock``) for every job in
flight; after each step the chunks it completed are handed to their jobs. Each job
(``prefill()``) issues one batched write per chunk as soon as the chunk is ready, so the write of
chunk i runs while the forward pass of chunk i+1 does. When the last write has landed the job
ends with ``PrefillDone(num_writes, first_token)`` for the decode worker and ``PrefillReport`` for
the router, and its local blocks are freed. An Abort stops the job between chunks; the decode
worker still gets a PrefillDone (ok=False) once no write is in flight, so its blocks return.

Features join through ``hooks`` (job_hooks.py: ``JobHook``), composed by the service shell: the
worker calls them at fixed points of a job's life and of the engine loop and knows none of them.
Draft-KV writes are one (draft_writes.py: a draft model stepped after each target step, the
draft KV written to a draft worker; docs/speculative.md).

The worker knows no NATS: the service (the shell) calls it and publishes what it returns
(``started()``, ``prefill()``'s ``PrefillResult``). It reaches decode workers' memory itself,
through the transport endpoints of its ``EndpointCache`` (the data plane is below it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.services.prefill.adverts import AdvertBook
from kvmesh.services.prefill.convert import KVMirrors
from kvmesh.services.prefill.core_loan import CoreLoan, DecodeIdleness
from kvmesh.services.prefill.job import STOP, Job, RankTarget
from kvmesh.services.prefill.job_hooks import JobHook
from kvmesh.services.prefill.job_results import PrefillResult, job_result
from kvmesh.services.prefill.job_writes import job_targets, write_chunk
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.plan import ChunkWrite, PlanError, PrefillTimeline
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob, PrefillStarted
from kvmesh.shared.engine.grammar_compile import AwaitedCompiles
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.sequence import ChunkReady, RequestError
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import MemoryRegion, TransportError
from kvmesh.shared.transport.endpoint_cache import EndpointCache

if TYPE_CHECKING:
    from kvmesh.services.prefill.tp_group import TPWrites

log = logs.get_logger(__name__)

# how long a gone router's queued jobs are refused (longer than any job waits in the queue)
GONE_ROUTER_MEMORY_S = 600.0


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
        hooks: Sequence[JobHook] = (),
        lock: asyncio.Lock | None = None,
        loan: CoreLoan | None = None,
        grammar_compile_timeout_s: float = 10.0,
        tp: TPWrites | None = None,
    ) -> None:
        """``hooks``: the features composed in (job_hooks.py); ``lock``: the engine lock, shared
        with hooks that run an engine of their own (default: a new one); ``loan``: decode's
        cores, taken for a step while every decode worker is idle (core_loan.py);
        ``grammar_compile_timeout_s``: the longest a job's grammar may take to compile;
        ``tp``: this worker leads tensor-parallel ranks (``engine`` is a ``LeaderEngine``): it
        writes its own heads of each chunk, the followers theirs (tp_group.py)."""
        self.engine = engine
        self.tp = tp
        # a structured output's grammar (its first token follows it), compiled in a thread
        # before the job takes the lock: another job's steps go on meanwhile
        self.grammars = (
            AwaitedCompiles(engine.grammars, grammar_compile_timeout_s)
            if engine.grammars is not None
            else None
        )
        self.loan = loan
        self.idleness = DecodeIdleness()
        self.hooks = tuple(hooks)
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
        self._jobs: dict[str, Job] = {}
        self._aborted: dict[str, float] = {}  # request id -> monotonic time of its Abort
        # router instance -> when the registry announced it gone (unix time): its jobs queued
        # before that die; a later one means it lives (it was counted gone while cut off)
        self._gone_routers: dict[str, float] = {}
        self._chunks: list[ChunkReady] = []  # filled by on_chunk in the engine thread
        self._lock = lock or asyncio.Lock()
        self._wake = asyncio.Event()
        self.metrics.jobs_running.set_function(lambda: len(self._jobs))

    def close(self) -> None:
        """Stop the grammar compile threads (a compile in flight ends on its own)."""
        if self.grammars is not None:
            self.grammars.close()

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def job_ids(self) -> list[str]:
        return list(self._jobs)

    # ---- the engine loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Step the engine while any job computes; hand each finished chunk to its job. After
        each target step the hooks step (a draft model: the target chunks' writes run
        meanwhile); the loop runs while the engine or a hook has work."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                async with self._lock:
                    is_busy = self.engine.has_unfinished()
                    if not is_busy and not any(hook.has_work() for hook in self.hooks):
                        break
                    chunks = await self._step_target() if is_busy else []
                self._hand_out(chunks)
                for hook in self.hooks:
                    await hook.step()

    async def _step_target(self) -> list[ChunkReady]:
        t0 = time.perf_counter()
        hits = self.engine.block_manager.num_hit_tokens
        if self.loan is None:
            await asyncio.to_thread(self.engine.step)
        else:
            widen = self.idleness.idle(self.adverts.loads(), time.monotonic())
            await asyncio.to_thread(self.loan.run, widen, self.engine.step)
            if widen:
                self.metrics.borrowed_steps.inc()
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

    def _hand_out(self, chunks: list[ChunkReady]) -> None:
        for chunk in chunks:
            job = self._jobs.get(chunk.request_id)
            if job is not None:
                job.chunks.put_nowait(chunk)

    def _on_chunk(self, chunk: ChunkReady) -> None:
        self._chunks.append(chunk)  # in the engine thread, during step(), under self._lock

    # ---- jobs ---------------------------------------------------------------------------------

    def started(self, msg: PrefillJob) -> PrefillStarted:
        """What tells the router and the decode worker that this worker took ``msg``'s job: from
        then on they count on it (and on hearing if it dies)."""
        return PrefillStarted(msg.request_id, msg.lease_id, self.worker_id)

    async def prefill(self, msg: PrefillJob) -> PrefillResult | None:
        """Run one job to its end: every write landed (or none in flight). Returns what to tell
        the decode worker and the router (and what the hooks announce); None for a duplicate of
        a job in hand."""
        rid = msg.request_id
        started_at = time.time()
        if rid in self._jobs:
            log.warning("ignored a duplicate prefill job", request_id=rid)
            return None
        for hook in self.hooks:
            hook.on_received(msg)
        if self._aborted.pop(rid, None) is not None:
            return self._result(msg, None, f"aborted before prefill started on {self.worker_id}")
        gone_at = self._gone_routers.get(msg.router) if msg.router else None
        if gone_at is not None and msg.enqueued_at <= gone_at:
            return self._result(msg, None, "its router is gone (nobody reads its tokens)")
        try:
            advert = await self.adverts.vouch(msg, self._advert_wait_s)
            spec = self.engine.kv_pool.spec
            where = (self.kv_spec, self.mirrors, self.endpoints, self.tp)
            targets = await job_targets(msg, advert, spec, *where)  # job_writes.py
            params = msg.sampling
            if params.structured_outputs is not None and self.grammars is not None:
                await self.grammars.ready(params.structured_outputs)  # off the loop and lock
        except (PlanError, TransportError, ValueError) as exc:  # StructuredOutputError too
            log.warning("prefill job refused", request_id=rid, error=str(exc))
            return self._result(msg, None, str(exc))
        if self._aborted.pop(rid, None) is not None:  # while it waited (its advert, grammar)
            return self._result(msg, None, f"aborted before prefill started on {self.worker_id}")
        timeline = PrefillTimeline(msg.enqueued_at, started_at)
        job = Job(msg, targets.planner, timeline, targets.endpoint, targets.mirror)
        job.others = targets.others
        self._jobs[rid] = job
        if self.tp is not None:  # the followers' word on their writes of it, from now on
            self.tp.reports.expect(rid)
        prompt = list(msg.prompt_ids)
        for hook in self.hooks:
            await hook.prepare(job)
        try:
            async with self._lock:
                for hook in self.hooks:  # what they prepared, and the prompt, added at once
                    hook.before_add(job)
                self.metrics.prompt_tokens.inc(len(prompt))
                self.engine.add_request(
                    rid,
                    list(msg.prompt_ids),
                    params,
                    prefill_only=True,
                    on_chunk=self._on_chunk,
                    **({} if self.tp is None else {"note": self.tp.note(msg)}),
                )
                for hook in self.hooks:
                    hook.admit(job, prompt)
        except RequestError as exc:
            del self._jobs[rid]
            return self._result(msg, None, str(exc))
        self._wake.set()
        try:
            async with asyncio.TaskGroup() as tg:
                for hook in self.hooks:
                    hook.start(job, tg)
                while (chunk := await job.chunks.get()) is not STOP:
                    write = job.planner.plan(
                        chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last
                    )
                    tg.create_task(self._write(job, write, chunk))
                    for other in job.others:  # a TP decode worker's other ranks' heads
                        other_write = other.planner.plan(
                            chunk.chunk_index, chunk.end_token, chunk.block_ids, chunk.is_last
                        )
                        tg.create_task(self._write(job, other_write, chunk, other))
                    for hook in self.hooks:
                        await hook.on_chunk(job, chunk, tg)
                    if chunk.is_last:
                        job.first_token = chunk.first_token
                        job.first_logprobs = chunk.first_logprobs
                        job.prompt_logprobs = chunk.prompt_logprobs
                        for hook in self.hooks:
                            await hook.on_computed(job)
                        break
            # every write has returned: no byte of ours is still on its way to the decode blocks
            if self.tp is not None and job.is_computed and not job.error:  # nor the followers'
                job.error = await self.tp.reports.wait(rid, self.tp.report_timeout_s)
        except PlanError as exc:  # an engine/plan disagreement: a bug, but never leak blocks
            job.error = f"internal error planning KV writes: {exc}"
            log.error("plan failed", request_id=rid, error=str(exc))
        finally:
            del self._jobs[rid]
            if self.tp is not None:
                self.tp.reports.forget(rid)
            async with self._lock:
                self.engine.abort(rid)  # frees the local blocks, computed or not
                for hook in self.hooks:
                    hook.on_end(job)
            self._wake.set()
        return self._result(msg, job, job.error)

    async def _write(
        self, job: Job, write: ChunkWrite, chunk: ChunkReady, rank: RankTarget | None = None
    ) -> None:
        """Write ``chunk``'s ``write`` to the decode worker's rank 0, or to its ``rank``
        (job_writes.py); the first write that fails stops the job."""
        msg = job.msg
        pool = self.engine.kv_pool
        try:
            await write_chunk(job, write, chunk, rank, self.region, pool, self.metrics)
        except TransportError as exc:
            if not job.error:
                job.error = (
                    f"KV write of chunk {write.chunk_index} to {msg.decode_worker_id} failed: {exc}"
                )
                log.warning("kv write failed", request_id=msg.request_id, error=str(exc))
                await self.endpoints.forget(msg.descriptor if rank is None else rank.descriptor)
                await self._stop(job)

    async def _stop(self, job: Job) -> None:
        """No more chunks for this job: the engines drop it, its queues get the stop marker."""
        if not job.is_computed:
            async with self._lock:
                self.engine.abort(job.msg.request_id)
        job.chunks.put_nowait(STOP)
        for hook in self.hooks:
            await hook.on_stop(job)

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

    async def on_router_gone(self, instance: str) -> int:
        """The registry announced the router ``instance`` gone: its jobs stop (as on an Abort:
        the decode worker gets a failed PrefillDone once no write is in flight, and frees the
        blocks) and a job of it queued before now and taken later is refused. Returns how many
        jobs stopped."""
        if not instance:
            return 0
        now = time.time()
        self._gone_routers = {
            r: at for r, at in self._gone_routers.items() if now - at < GONE_ROUTER_MEMORY_S
        }
        self._gone_routers[instance] = now
        doomed = [rid for rid, job in self._jobs.items() if job.msg.router == instance]
        for request_id in doomed:
            await self.abort(request_id, "its router is gone")
        return len(doomed)

    def _result(self, msg: PrefillJob, job: Job | None, error: str) -> PrefillResult:
        """How the job ended (job_results.py), told to the hooks and counted."""
        ok = job is not None and not error
        if ok:  # its stream starts on the decode worker now: no loan until an advert counts it
            self.idleness.delivered(msg.decode_worker_id, time.monotonic())
        draft_done = None
        for hook in self.hooks:
            draft_done = hook.finish(msg, job, ok, error) or draft_done
        timing = job.timeline.timing() if job is not None else None
        self.metrics.observe_job(timing, ok=ok)
        if job is not None:
            log.debug("prefill done", request_id=msg.request_id, ok=ok, error=error, timing=timing)
        return job_result(self.worker_id, msg, job, error, timing, draft_done)
