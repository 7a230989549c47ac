"""The decode service's NATS shell around DecodeWorker (the core, which knows no NATS).

Subjects (docs/mesh.md): ``decode_reserve(id)`` (ReserveRequest -> ReserveReply),
``decode_prefill_done(id)`` (PrefillDone), ``ABORT`` (Abort), ``worker_control(id)``
(WorkerControl -> WorkerHeartbeat with the new state); publishes ``DecodeAdvert`` on
``REGISTRY_ADVERTISE`` every heartbeat, its prefix cache's changes and digests on
``REGISTRY_KV_EVENTS`` / ``REGISTRY_KV_DIGEST`` (cache_reports.py), the TokenEvents the worker returns on
``request_tokens(rid)`` and the Aborts of expired leases on ``ABORT``. With ``--speculative``:
takes DraftProposals on ``decode_draft(id)`` and sends, after each step, the context deltas the
worker queued (``DRAFT_CONTEXT`` or ``draft_context(draft worker)``) and DraftForgets. The service runs the engine
loop: it decides when the worker steps (``min_step_interval_ms``) and publishes what each step
returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import torch
from kvmesh.services.decode.cache_reports import CacheReporter
from kvmesh.services.decode.compose import compose_features, engine_config
from kvmesh.services.decode.config import DecodeConfig
from kvmesh.services.decode.drafts import Outgoing
from kvmesh.services.decode.load import DecodeReach, WorkerLoad
from kvmesh.services.decode.metrics import DecodeMetrics
from kvmesh.services.decode.speculation import Speculation
from kvmesh.services.decode.store_puts import FinishedPuts
from kvmesh.services.decode.stream_handover import StreamHandover
from kvmesh.services.decode.stream_log import StreamLog
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.cache_events import KvCacheDigest, KvCacheEvents
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import DraftProposal
from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.messages.placement import LeaseCancel, LeaseRenew, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import Abort, StreamResume, TokenEvent
from kvmesh.shared.bus.messages.workers import DecodeAdvert, WorkerGone, WorkerHeartbeat
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.service_lifetime import background, serve_until_signal
from kvmesh.shared.bus.store_solicit import store_adverts_solicited
from kvmesh.shared.bus.worker_presence import heartbeat_loop, new_worker_id
from kvmesh.shared.bus.worker_shell import WorkerShell, serve_worker
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.identity import model_spec
from kvmesh.shared.model.loader import load_model
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Access, Transport, TransportConfig, create_transport
from nats.aio.client import Client
from nats.micro.request import Request

log = logs.get_logger(__name__)


class DecodeService:
    """Wires one DecodeWorker to NATS and the data plane."""

    def __init__(
        self,
        config: DecodeConfig,
        worker: DecodeWorker,
        transport: Transport | None,
        nc: Client,
        hearing: Hearing | None = None,
        *,
        speculation: Speculation | None = None,
        store: FinishedPuts | None = None,
        cache: CacheReporter | None = None,
        reach: DecodeReach | None = None,
        started_at: float | None = None,
    ) -> None:
        """``hearing``: the NATS connection's outages; no lease runs out during one. The
        features the service feeds from NATS: ``speculation`` (proposals in, contexts out),
        ``store`` (store adverts) and ``cache`` (prefix cache reports to the registry);
        ``reach``: what its adverts say of how to reach it (None: it never advertises);
        ``started_at``: the process's start, as its heartbeats say (default: now)."""
        self.config = config
        self.speculation = speculation
        self.store = store
        self.cache = cache
        self.hearing = hearing or Hearing()
        self.worker = worker
        self.transport = transport
        self.nc = nc
        self.reach = reach
        self.started_at = time.time() if started_at is None else started_at
        self.tg: asyncio.TaskGroup  # set by decode_service
        self.last_load = WorkerLoad.idle()
        # set when the engine runs out of work or starts again: an advert goes out at once, so
        # prefill workers that borrow decode's idle cores (--borrow-cpus, core_loan.py) start
        # and stop borrowing on it, not a heartbeat later
        self.load_turned = asyncio.Event()
        self.metrics_port: int | None = None  # bound by decode_service (None: no endpoint)
        # every stream's recent tokens, for a client that resumes it through another router
        self.handover = StreamHandover(
            nc,
            config.subjects,
            worker.worker_id,
            StreamLog(max_tokens=config.resume_max_tokens, grace_s=config.resume_grace_s),
        )

    async def load(self) -> WorkerLoad:
        self.last_load = await self.worker.load()
        self.worker.metrics.observe_load(self.last_load)  # the load gauges follow the adverts
        return self.last_load

    def heartbeat(self) -> WorkerHeartbeat:
        load = self.last_load
        return WorkerHeartbeat(
            self.worker.worker_id,
            self.config.role,
            load.state,
            load.num_running,
            load.num_waiting,
            self.started_at,
            time.time(),
        )

    async def advertise(self) -> None:
        reach, load = self.reach, await self.load()
        assert reach is not None, "a decode service without its reach does not advertise"
        advert = DecodeAdvert(
            worker_id=self.worker.worker_id,
            mode=self.config.mode,
            descriptor=reach.descriptor,
            block_bytes=reach.block_bytes,
            block_size=reach.block_size,
            kv_spec=reach.kv_spec,
            model_spec=reach.model_spec,
            reads_kv_store=reach.reads_kv_store,
            total_blocks=load.total_blocks,
            free_blocks=load.free_blocks,
            free_block_ranges=load.free_block_ranges,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            state=load.state,
            sent_at=time.time(),
            refused_accesses=self.transport.stats().refused if self.transport else 0,
            stray_immediates=self.worker.pending.num_stray_immediates,
            forged_announcements=self.worker.pending.num_forged_announcements,
        )
        await self.nc.publish(self.config.subjects.REGISTRY_ADVERTISE, encode_message(advert))

    async def advert_loop(self) -> None:
        while True:
            try:
                await self.advertise()
            except nats.errors.Error as exc:
                log.debug("advert failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.load_turned.wait(), self.config.heartbeat_s)
            self.load_turned.clear()

    async def engine_loop(self) -> None:
        """Drive the worker (a task body): admissions between steps, their first tokens out
        before the next step's, steps while the engine has work, every event published.

        Pacing: a step starts at most every ``min_step_interval_ms`` (0: back to back). A step
        that decodes a small batch costs a few ms, but back to back they keep a core busy; paced
        to the inter-token target they leave that core to prefill on a shared machine."""
        interval_s = self.config.min_step_interval_ms / 1000
        while True:
            await self.worker.wait_for_work()
            stepped = False
            while True:
                await self._publish_tokens(await self.worker.admit())
                if not self.worker.has_unfinished:
                    if stepped:  # the last stream ended: say so now
                        self.load_turned.set()
                    break
                if not stepped:  # busy again (a delivery or a local prefill): say so now
                    self.load_turned.set()
                stepped = True
                step_started = time.monotonic()
                await self._publish_tokens(await self.worker.step())
                await self._publish_drafts()
                if interval_s > 0:
                    # outside the worker's lock: reservations and admissions go on meanwhile
                    left = step_started + interval_s - time.monotonic()
                    if left > 0:
                        await asyncio.sleep(left)

    async def _publish_tokens(self, events: list[TokenEvent]) -> None:
        for event in events:
            self.handover.record(event, self._prompt_of)  # first: a replay has what went out
            await self.nc.publish(
                self.config.subjects.request_tokens(event.request_id), encode_message(event)
            )

    def _prompt_of(self, request_id: str) -> tuple[int, ...]:
        seq = self.worker.engine.seqs.get(request_id)
        return tuple(seq.prompt_ids) if seq is not None else ()

    async def on_stream_resume(self, req: Request) -> None:
        """A router takes over a stream whose client resumes it there (stream_handover.py)."""
        try:
            body = decode_message(req.data, StreamResume)
        except MessageError as exc:
            await req.respond_error("400", str(exc))
            return
        with logs.request_context(body.wire_id):
            replay = self.handover.replay(body)
            if replay.error:
                log.info("stream not resumed", error=replay.error)
            else:  # the new router's from now on: its old router's death does not abort it
                self.worker.hand_over(body.wire_id, body.router)
                log.info("stream resumed by another router", events=len(replay.events))
            try:
                await req.respond(encode_message(replay))
            except nats.errors.Error as exc:  # the router gave up: its client asks again
                log.warning("stream replay not sent", error=str(exc))

    async def _publish_drafts(self) -> None:
        """Send what the last step queued for the draft service (nothing waits for it)."""
        subjects = self.config.subjects
        if self.speculation is None:
            return
        for item in self.speculation.take_messages():
            if isinstance(item, Outgoing):
                subject = (
                    subjects.DRAFT_CONTEXT
                    if item.draft_worker_id is None
                    else subjects.draft_context(item.draft_worker_id)
                )
                data = encode_message(item.message)
            else:
                holder, forget = item
                subject, data = subjects.draft_forget(holder), encode_message(forget)
            try:
                await self.nc.publish(subject, data)
            except nats.errors.Error as exc:  # drafts are an optimisation: decode goes on
                log.debug("draft message not sent", subject=subject, error=str(exc))

    async def on_proposal(self, msg: DraftProposal) -> None:
        if self.speculation is not None:
            self.speculation.on_proposal(msg)

    async def cache_report_loop(self) -> None:
        """Tell the kv-registry what the prefix cache holds: its changes every
        ``cache_events_interval_s``, all of it every ``cache_digest_interval_s`` (and at once
        after an overflow). One task sends both, so they go out in ``seq`` order."""
        cache = self.cache
        if cache is None:
            return
        subjects = self.config.subjects
        next_digest = 0.0
        while True:
            events = cache.events()  # no lock: the log has its own
            if events is not None:
                await self._publish_cache_report(subjects.REGISTRY_KV_EVENTS, events)
            if cache.needs_digest or time.monotonic() >= next_digest:
                digest = await self.worker.between_steps(cache.digest)  # it reads the table
                await self._publish_cache_report(subjects.REGISTRY_KV_DIGEST, digest)
                next_digest = time.monotonic() + self.config.cache_digest_interval_s
            await asyncio.sleep(self.config.cache_events_interval_s)

    async def _publish_cache_report(self, subject: str, msg: KvCacheEvents | KvCacheDigest) -> None:
        try:
            await self.nc.publish(subject, encode_message(msg))
        except nats.errors.Error as exc:  # the registry notices the gap and waits for a digest
            log.debug("cache report not sent", subject=subject, error=str(exc))

    async def lease_loop(self) -> None:
        """Expire leases every ``lease_check_s``; tell each expired lease's prefill to stop.
        Not while NATS is down, and an outage moves every deadline by its length: no holder
        could renew meanwhile."""
        num_outages = self.hearing.num_outages
        while True:
            await asyncio.sleep(self.config.lease_check_s)
            if not self.hearing.is_connected:
                continue
            if self.hearing.num_outages != num_outages:
                num_outages = self.hearing.num_outages
                self.worker.postpone_leases(self.hearing.last_outage_s)
            for abort in self.worker.expire_leases():
                try:
                    await self.nc.publish(self.config.subjects.ABORT, encode_message(abort))
                except nats.errors.Error as exc:  # its blocks stay quarantined until it stops
                    log.warning("abort not sent", request_id=abort.request_id, error=str(exc))
            if self.worker.num_detached:  # a gone router's streams nobody resumed in time
                await self._publish_tokens(self.worker.expire_detached())

    async def completion_loop(self) -> None:
        if self.transport is None:  # colocated: nothing is written to us
            return
        async for completion in self.transport.completions():
            self.worker.on_completion(completion)

    async def on_reserve(self, req: Request) -> None:
        # Concurrently: each reserve waits for the step in flight, all of them for the same one.
        guard_of(self.nc).spawn(self.tg, self._reserve(req), req.subject)

    async def _reserve(self, req: Request) -> None:
        try:
            body = decode_message(req.data, ReserveRequest)
        except MessageError as exc:
            await req.respond_error("400", str(exc))
            return
        with logs.request_context(body.request_id):
            max_lease_ms = int(self.config.max_lease_s * 1000)
            if body.lease_ms > max_lease_ms:  # policy: nobody holds blocks this long unrenewed
                body = msgspec.structs.replace(body, lease_ms=max_lease_ms)
            reply = await self.worker.reserve(body)
            if reply.ok:
                log.debug("reserved", local_prefill=body.local_prefill, blocks=len(reply.block_ids))
            else:
                log.info("reserve refused", error=reply.error)
            try:
                await req.respond(encode_message(reply))
            except nats.errors.Error as exc:  # the registry gave up waiting; the lease frees it
                log.warning("reserve reply not sent", error=str(exc))

    async def on_control(self, action: str) -> None:
        """``kvmesh admin drain|resume <decode worker>``: drained, it takes no new reservation
        (its advert, sent now, says so) and finishes the sequences it holds."""
        self.worker.is_draining = action == "drain"
        log.info("worker control", action=action)
        await self.advertise()

    async def on_abort(self, msg: Abort) -> None:
        with logs.request_context(msg.request_id):
            event = self.worker.abort(msg.request_id, msg.job_withdrawn)
            if event is not None:
                await self._publish_tokens([event])

    async def on_lease_cancel(self, msg: LeaseCancel) -> None:
        with logs.request_context(msg.request_id):
            if self.worker.cancel_lease(msg.request_id, msg.lease_id):
                log.info("reservation freed: the registry gave up on it", reason=msg.reason)

    async def on_lease_renew(self, msg: LeaseRenew) -> None:
        lease_ms = min(msg.lease_ms, int(self.config.max_lease_s * 1000))  # policy caps it
        if not self.worker.renew(msg.request_id, msg.lease_id, lease_ms):
            log.debug("ignored renewal of no live lease", request_id=msg.request_id)

    async def on_prefill_started(self, msg: PrefillStarted) -> None:
        with logs.request_context(msg.request_id):
            self.worker.on_prefill_started(msg)

    async def on_worker_gone(self, msg: WorkerGone) -> None:
        if msg.role == "router":  # its requests are read by nobody: drop them, free their blocks
            log.info("router gone: its requests are dropped", router=msg.worker_id)
            await self._publish_tokens(self.worker.on_router_gone(msg.instance))
            return
        if msg.role == "draft":
            if self.speculation is not None:
                self.speculation.on_worker_gone(msg.worker_id)
            return
        self.worker.on_worker_gone(msg)

    async def on_prefill_done(self, msg: PrefillDone) -> None:
        with logs.request_context(msg.request_id):
            self.worker.on_prefill_done(msg)

    async def on_store_advert(self, advert: StoreAdvert) -> None:
        if self.store is not None:
            self.store.on_advert(advert)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work; wait (bounded) for what runs to finish."""
        self.worker.is_draining = True
        await self.advertise()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = await self.load()
            if not load.num_running and not load.num_waiting:
                return
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def decode_service(config: DecodeConfig) -> AsyncIterator[DecodeService]:
    """Model, KV pool over transport memory, NATS, subscriptions and loops: ready to serve."""
    worker_id = config.worker_id or new_worker_id(config.role)
    placed = config.cpu_placement().apply()  # first: torch's and asyncio's threads inherit it
    if placed:
        log.info("cpu placement", applied=", ".join(placed))
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    disagg = config.mode == "disagg"  # colocated workers take no remote writes: no data plane
    # what peers on other hosts dial (a colocated worker has no data plane to reach)
    bind_host, advertise_host = config.transport_hosts() if disagg else ("127.0.0.1",) * 2
    tconf = TransportConfig(
        peer_id=worker_id, tcp_host=bind_host, tcp_advertise_host=advertise_host
    )
    subjects = config.subjects
    hearing = Hearing(connected_since=time.monotonic())
    started_at = time.time()
    async with (
        create_transport(config.transport, tconf)
        if disagg
        else contextlib.nullcontext() as transport,
        connect_nats(
            config.nats_url, worker_id, security=config.nats_security, hearing=hearing
        ) as nc,
    ):
        # "starting" until the model is loaded and the pool made: a restarted worker is
        # coming, not gone, and routers wait for it (docs/faults.md)
        async with background(
            heartbeat_loop(
                nc,
                subjects,
                config.role,
                worker_id,
                lambda: WorkerHeartbeat(
                    worker_id, config.role, "starting", started_at=started_at, sent_at=time.time()
                ),
                config.heartbeat_s,
            )
        ):
            model, tokenizer = await asyncio.to_thread(
                load_model, config.model,
                parse_dtype(config.dtype, "--dtype") if config.dtype else None, config.device,
            )  # fmt: skip
            econf, spec = engine_config(config, model)
            # On the host the pool lives in transport memory (shm: a segment the prefill maps);
            # device pools are the engine's own and need a backend that reaches them (rdma).
            on_host = torch.device(config.device).type == "cpu"
            buffer = (
                transport.allocate(econf.num_blocks * spec.block_bytes)
                if disagg and on_host
                else None
            )
            engine = LLMEngine(model, tokenizer, econf, kv_buffer=buffer)
        region = transport.register(engine.kv_pool.raw, Access.REMOTE_WRITE) if disagg else None
        metrics = DecodeMetrics()
        lock = asyncio.Lock()  # the engine's: the worker's, and the puts' and swap-ins' later
        features = compose_features(config, engine, worker_id, nc, transport, region, metrics, lock)
        store, swaps = features.store, features.swaps
        worker = DecodeWorker(
            engine,
            worker_id=worker_id,
            base_addr=region.addr if region else engine.kv_pool.base_addr,
            colocated=not disagg,
            windows=LeaseWindows(transport, region, spec.block_bytes) if region else None,
            quarantine_s=config.quarantine_s,
            metrics=metrics,
            hooks=features.hooks,
            lock=lock,
            reader=features.reader,
            grammar_compile_timeout_s=config.grammar_compile_timeout_s,
            resume_window_s=(
                config.heartbeat_s if config.resume_window_s is None else config.resume_window_s
            ),
        )
        service = DecodeService(
            config,
            worker,
            transport,
            nc,
            hearing,
            speculation=features.speculation,
            store=store,
            cache=features.cache,
            reach=DecodeReach(
                descriptor=transport.descriptor().public() if transport else None,
                block_bytes=spec.block_bytes,
                block_size=spec.block_size,
                kv_spec=engine.kv_spec,
                model_spec=model_spec(model.config),
                reads_kv_store=features.reader is not None,
            ),
            started_at=started_at,
        )
        await service.load()
        service.tg = asyncio.TaskGroup()
        shell = WorkerShell(
            role=config.role,
            worker_id=worker_id,
            heartbeat=service.heartbeat,
            config=config,
            metrics=worker.metrics,
            ready="decode worker ready",
            control=service.on_control,
            endpoints=(
                ("reserve", subjects.decode_reserve(worker_id), service.on_reserve),
                (
                    "stream_resume",
                    subjects.decode_stream_resume(worker_id),
                    service.on_stream_resume,
                ),
            ),
            routes=(
                (subjects.decode_prefill_done(worker_id), PrefillDone, service.on_prefill_done),
                (subjects.ABORT, Abort, service.on_abort),
                (
                    subjects.decode_prefill_started(worker_id),
                    PrefillStarted,
                    service.on_prefill_started,
                ),
                (subjects.REGISTRY_WORKER_GONE, WorkerGone, service.on_worker_gone),
                (subjects.decode_lease_renew(worker_id), LeaseRenew, service.on_lease_renew),
                (subjects.decode_lease_cancel(worker_id), LeaseCancel, service.on_lease_cancel),
                (subjects.decode_draft(worker_id), DraftProposal, service.on_proposal),
                (subjects.REGISTRY_STORE_ADVERTISE, StoreAdvert, service.on_store_advert),
            ),
            contexts=(
                (
                    store_adverts_solicited(nc, subjects, worker_id)
                    if store is not None
                    else contextlib.nullcontext()
                ),
                service.tg,
                service.handover.subscribed(),
            ),
            loops=(
                service.engine_loop,
                service.lease_loop,
                service.completion_loop,
                service.cache_report_loop,
            ),
            # Advertised only once ``reserve`` answers: a router that saw the advert finds it.
            after_ready=(service.advert_loop,),
            metadata={"mode": config.mode},
            ready_fields={
                "mode": config.mode,
                "speculative": config.speculative,
                "transport": transport.name if transport else None,
                "num_blocks": econf.num_blocks,
                "kv_spec": engine.kv_spec,
            },
        )
        async with serve_worker(nc, subjects, shell, log) as service.metrics_port:
            yield service
        worker.close()
        if swaps is not None:
            await swaps.aclose()  # before the client closes
        if store is not None:
            await store.aclose()


async def run(config: DecodeConfig) -> None:
    async with decode_service(config) as service:
        await serve_until_signal()
        await service.drain(config.drain_timeout_s)
