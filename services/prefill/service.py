"""The prefill service's NATS shell around PrefillWorker (the core, which knows no NATS).

Pulls ``PrefillJob``s from the JetStream work queue (kvmesh.shared.bus.prefill_job_stream) only while it has a
free slot (``max_concurrent_jobs``), so an idle peer takes the next job rather than a busy worker
hoarding it; follows ``ABORT``; checks every job against its decode worker's ``DecodeAdvert``;
publishes what the worker returns: ``PrefillStarted`` when it takes a job, ``PrefillDone`` and
``PrefillReport`` when the job ends, after what a feature announces of the job (the draft KV's
``draft_kv_done(draft worker)``: the draft worker has the KV before the decode's first context,
docs/speculative.md). Its features (compose.py: the kv-store's prompt prefixes, draft KV) bring
their own subscriptions and NATS traffic: the service names none of them
(shared/bus/worker_feature.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

import nats.errors
import torch
from kvmesh.services.prefill.compose import PrefillParts, compose_features
from kvmesh.services.prefill.config import PrefillConfig
from kvmesh.services.prefill.draft_engine import load_draft_engine
from kvmesh.services.prefill.job_results import PrefillResult
from kvmesh.services.prefill.metrics import PrefillMetrics
from kvmesh.services.prefill.tp_group import (
    RankReports,
    TPWrites,
    join_group,
    start_tp_group,
)
from kvmesh.services.prefill.worker import PrefillWorker
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.token_streams import Abort
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.prefill_job_stream import PrefillJobQueue
from kvmesh.shared.bus.service_lifetime import serve_until_signal
from kvmesh.shared.bus.worker_feature import Features, Site
from kvmesh.shared.bus.worker_presence import new_worker_id
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.engine.tp_leader import LeaderEngine
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.loader import load_model
from kvmesh.shared.model.tensor_parallel import shard_model
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import TransportConfig, create_transport
from kvmesh.shared.transport.endpoint_cache import EndpointCache
from nats.aio.client import Client
from nats.aio.msg import Msg

log = logs.get_logger(__name__)


class PrefillService:
    def __init__(
        self,
        config: PrefillConfig,
        worker: PrefillWorker,
        nc: Client,
        tg: asyncio.TaskGroup,
        features: Features = Features(),
    ) -> None:
        """``features``: the worker's (compose.py), closed when it stops."""
        self.config = config
        self.role = "prefill"
        self.features = features
        self.worker = worker
        self.worker_id = worker.worker_id
        self.metrics = worker.metrics
        self.nc = nc
        self.subjects: Subjects = config.subjects
        self.started_at = time.time()
        self.is_draining = False
        self._tg = tg
        self._slots = asyncio.Semaphore(config.max_concurrent_jobs)
        self.metrics_port: int | None = None  # bound by prefill_service (None: no endpoint)

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            self.worker_id,
            self.role,
            # waiting jobs stay in the shared queue (admin status shows its depth)
            WorkerLoad(WorkerState.of(self.is_draining), num_running=self.worker.num_jobs),
            started_at=self.started_at,
            sent_at=time.time(),
            tp=self.config.tp,
        )

    async def pull_loop(self, queue: PrefillJobQueue) -> None:
        """Take a job from the queue whenever a slot is free (and not draining)."""
        failing = False  # the last pull failed: say so once, and once when pulls work again
        while True:
            await self._slots.acquire()
            if self.is_draining:  # leave the queue to the other workers
                self._slots.release()
                await asyncio.sleep(0.1)
                continue
            try:
                msg = await queue.next(timeout_s=1.0)
            except nats.errors.Error as exc:  # reconnecting, or JetStream unavailable: retry
                self._slots.release()
                if not failing:
                    log.warning("cannot pull from the prefill queue; retrying", error=str(exc))
                failing = True
                await asyncio.sleep(0.2)
                continue
            if failing:
                log.info("pulling from the prefill queue again")
                failing = False
            if msg is None:
                self._slots.release()
                continue
            if self.is_draining:  # drained while this pull waited: hand the job to a peer
                self._slots.release()
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()  # JetStream redelivers it at once
                continue
            try:
                job = decode_message(msg.data, PrefillJob)
            except MessageError as exc:
                self._slots.release()
                await _ack_quietly(queue, msg)  # nobody can do anything with it
                guard_of(self.nc).refuse("malformed", msg.subject, str(exc))
                continue
            # Announce, then acknowledge: if this worker dies before the announcement, the job
            # goes to another worker; after it, the router hears our WorkerGone and runs it again.
            try:
                await self._announce_started(job)
                await queue.ack(msg)
            except nats.errors.Error as exc:  # unannounced or unacknowledged: JetStream redelivers
                self._slots.release()
                log.warning(
                    "could not take a prefill job", request_id=job.request_id, error=str(exc)
                )
                continue
            # a job whose fields make the prefill fail fails alone (shared/bus/message_guard.py)
            guard_of(self.nc).spawn(self._tg, self._run_job(job), msg.subject)

    async def _announce_started(self, job: PrefillJob) -> None:
        """Tell the decode worker and the router that this worker took the job."""
        started = encode_message(self.worker.started(job))
        await self.nc.publish(self.subjects.decode_prefill_started(job.decode_worker_id), started)
        await self.nc.publish(self.subjects.request_prefill_started(job.request_id), started)

    async def _run_job(self, job: PrefillJob) -> None:
        try:
            with logs.request_context(job.request_id):
                result = await self.worker.prefill(job)
                if result is not None:
                    await self._announce_result(job, result)
        finally:
            self._slots.release()

    async def _announce_result(self, job: PrefillJob, result: PrefillResult) -> None:
        """``PrefillDone`` to the decode worker (its blocks wait for it), the report to the
        router. Unsent (NATS gone for good), the decode worker's lease frees the blocks."""
        try:
            if result.draft_done is not None:  # first: the decode's first context comes after
                draft_worker_id, draft_done = result.draft_done
                await self.nc.publish(
                    self.subjects.draft_kv_done(draft_worker_id), encode_message(draft_done)
                )
            await self.nc.publish(
                self.subjects.decode_prefill_done(job.decode_worker_id),
                encode_message(result.done),
            )
            if result.report is not None:
                await self.nc.publish(
                    self.subjects.request_prefill_report(job.request_id),
                    encode_message(result.report),
                )
        except nats.errors.Error as exc:
            log.warning("prefill outcome not sent", request_id=job.request_id, error=str(exc))

    async def drain(self, timeout_s: float) -> None:
        """Take no new job; let those in flight finish for ``timeout_s``, then abort them."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self.worker.num_jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in self.worker.job_ids():
            await self.worker.abort(request_id, f"prefill worker {self.worker.worker_id} stopped")
        while self.worker.num_jobs:
            await asyncio.sleep(0.01)

    async def on_control(self, action: str) -> None:
        """``kvmesh admin drain|resume <prefill worker>``: drained, it takes no new job from the
        queue (its peers take them) and finishes the ones in hand."""
        self.is_draining = action == "drain"
        log.warning(f"worker control: {action}", worker_id=self.worker.worker_id)

    async def on_abort(self, abort: Abort) -> None:
        await self.worker.abort(abort.request_id, abort.reason)

    async def on_worker_gone(self, gone: WorkerGone) -> None:
        if gone.role == "router":  # nobody reads its requests' tokens: stop their jobs
            stopped = await self.worker.on_router_gone(gone.instance)
            if stopped:
                log.warning("router gone: its prefill jobs stopped", router=gone.worker_id)

    async def on_advert(self, advert: DecodeAdvert) -> None:
        self.worker.adverts.note(advert)


@contextlib.asynccontextmanager
async def prefill_service(config: PrefillConfig) -> AsyncIterator[PrefillService]:
    worker_id = config.worker_id or new_worker_id("prefill")
    placed = config.cpu_placement().apply()  # first: torch's and asyncio's threads inherit it
    if placed:
        log.info("cpu placement", applied=", ".join(placed))
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    loan = config.core_loan(frozenset(os.sched_getaffinity(0)))
    if loan is not None:
        log.info("cpu loan", loan=loan.describe())
    dtype = parse_dtype(config.dtype, "--dtype") if config.dtype else None
    model, tokenizer = await asyncio.to_thread(load_model, config.model, dtype, config.device)
    econf = config.engine_config(dtype, config.kv_cache_bytes, config.num_blocks)
    tp_group = tp_writes = None
    if config.tp > 1:  # this process leads N ranks that appear as one worker (docs/tp.md)
        tp_group, meeting = start_tp_group(config, worker_id)
        with meeting:  # held until rank 0's store binds it
            port = meeting.getsockname()[1]
            await asyncio.to_thread(join_group, 0, config.tp, port, config.device)
        shard_model(model)
    engine = LLMEngine(model, tokenizer, econf)
    if tp_group is not None:
        reports = RankReports(config.tp - 1)
        tp_writes = TPWrites.for_leader(
            engine.kv_pool.spec, model.config.num_key_value_heads, config.tp, reports
        )
        engine = LeaderEngine(engine, on_broken=tp_group.ranks.mark_broken)
    draft_engine = None
    if config.draft_model:  # start-up errors (vocabulary) before anything connects
        draft_engine = await asyncio.to_thread(load_draft_engine, config, tokenizer)
    bind_host, advertise_host = config.transport_hosts()  # what peers on other hosts dial
    tconf = TransportConfig(
        peer_id=worker_id, tcp_host=bind_host, tcp_advertise_host=advertise_host
    )
    async with (
        create_transport(config.transport, tconf) as transport,
        EndpointCache(transport) as endpoints,
        connect_nats(config.nats_url, worker_id, security=config.nats_security) as nc,
    ):
        subjects = config.subjects
        region = transport.register(engine.kv_pool.raw)
        draft_region = None
        if draft_engine is not None:  # the draft KV's source, a second region
            draft_region = transport.register(draft_engine.kv_pool.raw)
        kv_spec = engine.kv_spec if tp_group is None else TPWrites.kv_spec(engine)
        metrics = PrefillMetrics()
        lock = asyncio.Lock()  # the engines': the worker's, and the draft KV hook's
        parts = PrefillParts(
            config, engine, worker_id, kv_spec, nc, transport, region, endpoints, metrics, lock,
            draft_engine, draft_region, is_tp=tp_group is not None,
        )  # fmt: skip
        features = compose_features(parts)
        worker = PrefillWorker(
            engine,
            region,
            endpoints,
            worker_id=worker_id,
            kv_spec=kv_spec,
            abort_memory_s=config.abort_memory_s,
            metrics=metrics,
            hooks=features.hooks,
            lock=lock,
            loan=loan,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            tp=tp_writes,
        )
        site = Site(nc, subjects, worker_id)
        loops = (worker.run, lambda: service.pull_loop(queue))
        if tp_group is not None:  # a rank that exits takes the worker down
            loops += (tp_group.watch, lambda: tp_group.relay(reports))
        async with asyncio.TaskGroup() as tg:
            service = PrefillService(config, worker, nc, tg, features.features)
            queue = PrefillJobQueue(nc, subjects)
            shell = WorkerShell(
                service,
                ready="prefill worker ready",
                control=service.on_control,
                routes=(
                    (subjects.ABORT, Abort, service.on_abort),
                    (subjects.REGISTRY_WORKER_GONE, WorkerGone, service.on_worker_gone),
                    (subjects.REGISTRY_ADVERTISE, DecodeAdvert, service.on_advert),
                    *service.features.routes(site),
                ),
                contexts=(*service.features.contexts(site), queue),
                loops=(*loops, *service.features.loops(site)),
                ready_fields={
                    "transport": config.transport,
                    "chunk_tokens": config.chunk_tokens,
                    "kv_spec": worker.kv_spec,
                    "tp": config.tp,
                },
            )
            async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
                yield service
                await service.drain(timeout_s=config.drain_timeout_s)
                worker.close()
                await service.features.aclose()  # before the client closes
                if tp_group is not None:
                    engine.close()
                    await asyncio.to_thread(tp_group.stop)


async def _ack_quietly(queue: PrefillJobQueue, msg: Msg) -> None:
    with contextlib.suppress(nats.errors.Error):
        await queue.ack(msg)


async def run(config: PrefillConfig) -> None:
    async with prefill_service(config):
        await serve_until_signal()
