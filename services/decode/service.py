"""The decode service's NATS shell around DecodeWorker (the core, which knows no NATS).

Subjects (docs/mesh.md): ``decode_reserve(id)`` (ReserveRequest -> ReserveReply),
``decode_prefill_done(id)`` (PrefillDone), ``ABORT`` (Abort), ``worker_control(id)``
(WorkerControl -> WorkerHeartbeat with the new state); publishes ``DecodeAdvert`` on
``REGISTRY_ADVERTISE`` every heartbeat, the TokenEvents the worker returns on
``request_tokens(rid)`` and the Aborts of expired leases on ``ABORT``. Its features (compose.py:
speculation, kv-store puts and swaps, the prefix cache's reports to the registry) bring their
own subscriptions, loops and advert fields, and the messages they queue go out after each
step: the service names none of them (shared/bus/worker_feature.py). It runs the engine loop:
it decides when the worker steps (``min_step_interval_ms``) and publishes what each step
returns. It is started by serve.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import nats.errors
from kvmesh.services.decode.config import DecodeConfig
from kvmesh.services.decode.load import IDLE
from kvmesh.services.decode.stream_handover import StreamHandover
from kvmesh.services.decode.stream_log import StreamLog
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.placement import LeaseCancel, LeaseRenew, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import Abort, StreamResume, TokenEvent
from kvmesh.shared.bus.messages.workers import (
    BlockPool,
    DataPlaneRefusals,
    DecodeAdvert,
    DecodeReach,
    WorkerGone,
    WorkerHeartbeat,
    WorkerLoad,
)
from kvmesh.shared.bus.nats_request import read_request
from kvmesh.shared.bus.worker_feature import Features
from kvmesh.shared.obs import logs
from kvmesh.shared.transport import Transport
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
        features: Features = Features(),
        reach: DecodeReach | None = None,
        started_at: float | None = None,
    ) -> None:
        """``hearing``: the NATS connection's outages; no lease runs out during one;
        ``features``: the worker's (compose.py), whose messages go out after each step and
        whose fields its adverts carry; ``reach``: what its adverts say of how to reach it
        (None: it never advertises); ``started_at``: the process's start, as its heartbeats
        say (default: now)."""
        self.config = config
        self.role = config.role
        self.features = features
        self.hearing = hearing or Hearing()
        self.worker = worker
        self.worker_id = worker.worker_id
        self.metrics = worker.metrics
        self.transport = transport
        self.nc = nc
        self.reach = reach
        self.started_at = time.time() if started_at is None else started_at
        self.tg: asyncio.TaskGroup  # set by decode_service
        self.last_load, self.last_pool = IDLE
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

    async def load(self) -> tuple[WorkerLoad, BlockPool]:
        self.last_load, self.last_pool = await self.worker.load()
        # the load gauges follow the adverts
        self.worker.metrics.observe_load(self.last_load, self.last_pool)
        return self.last_load, self.last_pool

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            self.worker_id, self.role, self.last_load, self.started_at, time.time()
        )

    async def advertise(self) -> None:
        assert self.reach is not None, "a decode service without its reach does not advertise"
        load, pool = await self.load()
        refusals = DataPlaneRefusals(
            refused_accesses=self.transport.stats().refused if self.transport else 0,
            stray_immediates=self.worker.pending.num_stray_immediates,
            forged_announcements=self.worker.pending.num_forged_announcements,
        )
        # a feature's fields (a TP group's tp) over the reach's
        reach = msgspec.structs.replace(self.reach, **self.features.advert())
        advert = DecodeAdvert(
            self.worker.worker_id, self.config.mode, reach, load, pool, time.time(), refusals
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
                await self.features.send(self.nc, self.config.subjects)  # nothing waits for it
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
        body = await read_request(req, StreamResume)
        if body is None:
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
        body = await read_request(req, ReserveRequest)
        if body is None:
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
        self.worker.on_worker_gone(msg)  # a prefill's reservations (a feature hears the rest)

    async def on_prefill_done(self, msg: PrefillDone) -> None:
        with logs.request_context(msg.request_id):
            self.worker.on_prefill_done(msg)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new work; wait (bounded) for what runs to finish."""
        self.worker.is_draining = True
        await self.advertise()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load, _ = await self.load()
            if not load.num_running and not load.num_waiting:
                return
            await asyncio.sleep(0.05)
