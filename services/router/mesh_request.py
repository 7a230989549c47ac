"""One request on the mesh over NATS: place -> prefill job -> token relay -> abort, and again.

``subscribe`` listens on the attempt's event subjects before anything is sent (so no token can
be missed); ``start`` asks the kv-registry for a placement (waiting while the mesh is full) and
publishes the prefill job unless the decode worker prefills locally (placing.py); ``events()``
relays TokenEvents until one carries a finish_reason. When something the request depends on
fails it runs again under a new wire id: retried before its first token, migrated after
(attempts.py decides, recovery.py says which errors and waits). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats.errors
from kvmesh.services.router.attempts import Attempts
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import GatewayTimeoutError, MeshError, OverloadedError
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.placing import RemotePrefill, ask_registry, publish_abort
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.queue_health import PrefillQueueHealth
from kvmesh.services.router.recovery import (
    RECONNECT_SILENCE_S,
    PlacementLostError,
    no_decode_worker,
    placement_refused_error,
    prefills_locally,
    room_backoff_s,
    stop_waiting_for_room,
    token_deadline,
)
from kvmesh.services.router.request_events import AttemptEvents, MalformedEvent
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared.bus.messages.placement import PlaceReply, PlaceRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import StreamReplay, TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.bus.wire_ids import attempt_of
from kvmesh.shared.config.subjects import Subjects
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)


class MeshRequest:
    """One request in flight on the mesh; iterate ``events()`` for its tokens."""

    def __init__(self, mesh: RouterMesh, request_id: str, prompt: Prompt, timer: RequestTimer):
        self._mesh = mesh
        self._nc, self._subjects, self._config = mesh.nc, mesh.subjects, mesh.config
        self._sub: Subscription | None = None
        self._lost: set[str] = set()  # workers whose loss also loses this request
        self.response_id = request_id  # what the client sees; constant across attempts
        # wire ids, runs again, the tokens sent so far and the current attempt's prompt
        self.attempts = Attempts(request_id, prompt, mesh.config.max_retries)
        self.timer = timer
        self.is_finished = False  # a TokenEvent with finish_reason arrived
        self._first_deadline = 0.0  # set by start(); retries share it, a migration starts anew
        self._last_event_at = 0.0  # of the last token event: the next-token timeout runs from it
        self._replayed: list[TokenEvent] = []  # a resumed stream's events so far (adopt)
        self.is_resumed = False  # adopted from a router that died (adopt)
        self._begin_attempt(request_id)

    def attach(self, wire_id: str) -> None:
        """Follow attempt ``wire_id`` of this request instead of placing one (a client resumes
        its stream here after its router died; stream_resume.py); ``subscribe`` next, then
        ``adopt``."""
        self.attempts.num_attempts = attempt_of(wire_id)[1] + 1
        self._begin_attempt(wire_id)

    def adopt(self, worker_id: str, replay: StreamReplay, relayed: list[TokenEvent]) -> None:
        """Take over the attached attempt, streaming on decode worker ``worker_id``:
        ``replay``'s events count as arrived; ``events()`` yields ``relayed`` (the replay cut
        where the client stopped) first, then the live events, skipping those the replay
        brought too (made between the subscription and the replay)."""
        attempts = self.attempts
        if replay.prior_token_ids:  # a migrated attempt: its prompt carries that output
            attempts.generated = list(replay.prior_token_ids)
            assert attempts.migrate(), "a migrated attempt owes tokens"
        self._may_hold_blocks = True  # an abort frees them
        self.mark_lost(worker_id)  # its decode worker
        for event in replay.events:
            self.is_finished = attempts.record(event)
        self._replayed = relayed
        self.is_resumed = True
        self._last_event_at = time.monotonic()

    def _begin_attempt(self, wire_id: str) -> None:
        """Fresh per-attempt state: the wire id (retries get -r1, -r2, ...) and nothing placed."""
        self.request_id = wire_id
        self.placement: PlaceReply | None = None
        self.prefill_worker = ""  # from its PrefillStarted
        self._remote = RemotePrefill()  # its job and lease (the last attempt's closed: close())
        self._lost.clear()
        self.is_local_prefill = prefills_locally(
            self._config,
            len(self.attempts.prompt.prompt_ids),
            self._mesh.prefill_pool,
            time.monotonic(),
        )
        self.is_aborted = False
        self._may_hold_blocks = False  # a placement was asked for and not refused
        self._num_reconnects = self._nc.stats["reconnects"]  # NATS reconnects before this attempt
        self._events = AttemptEvents(self._subjects, wire_id)

    @property
    def num_accepted_drafts(self) -> int:
        """Of the tokens relayed, accepted drafts (all attempts)."""
        return self.attempts.num_accepted_drafts

    def mark_lost(self, worker_id: str) -> None:
        """Losing ``worker_id`` loses this request too (e.g. the last prefill worker went while
        its job waited in the queue)."""
        self._lost.add(worker_id)

    async def subscribe(self) -> None:
        """Listen on this attempt's event subjects (before anything is sent: no token is missed)."""
        self._sub = await self._nc.subscribe(self._subjects.request_events_all(self.request_id))

    async def close(self) -> None:
        self._remote.stop_renewing()
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None

    def depends_on(self, worker_id: str) -> bool:
        """Whether losing ``worker_id`` loses this request (its decode worker, or the prefill
        worker computing it before the first token)."""
        if self.is_finished:
            return False
        if worker_id in self._lost:
            return True
        if self.placement is not None and self.placement.worker_id == worker_id:
            return True
        return self.attempts.num_events == 0 and self.prefill_worker == worker_id

    async def start(self) -> None:
        """Place the request (waiting in the admission queue while the mesh is full) and, for
        remote prefill, publish its prefill job and keep its lease alive until the first token."""
        started = time.monotonic()
        self._first_deadline = started + self._config.first_token_timeout_s
        await self._place_and_dispatch(started)

    async def _run_again(self, why: str, role: str) -> TokenEvent | None:
        """Something this request depended on failed (``why``): run it again, from the start
        before its first token, else by migrating the stream; a MeshError once --max-retries
        runs are spent (attempts.py decides). Returns the final event when nothing is owed any
        more."""
        if self.attempts.run_again(why) == "retry":
            await self._retry(why, role)
            return None
        return await self._migrate(why)

    async def _retry(self, why: str, role: str) -> None:
        """Before the first token: drop this attempt and run the request again under a new wire
        id (the old one may still hold blocks). ``role``: what failed, for the retry metric."""
        log.warning("%s before the first token of %s; retrying", why, self.response_id)
        await self._next_attempt(why, role)
        await self._place_and_dispatch(time.monotonic())

    async def _next_attempt(self, why: str, role: str) -> None:
        """Abort this attempt (it may hold blocks) and start the next under a new wire id,
        subscribed and not placed yet."""
        await self.abort(why)
        await self.close()
        self._mesh.metrics.retries.labels(role).inc()
        self._begin_attempt(self.attempts.next_wire_id("r"))
        await self.subscribe()

    async def _migrate(self, why: str) -> TokenEvent | None:
        """The stream broke (its decode worker died, or its tokens were lost): place the request
        again with its prompt plus the tokens sent so far as the new prompt, for the tokens still
        owed, under a new wire id; the client's stream goes on from there (greedy output is what
        an undisturbed run gives). Returns the final event when nothing is owed any more (the
        finish event was lost)."""
        num_sent = len(self.attempts.generated)
        log.warning(
            "%s after %d tokens of %s; migrating the stream", why, num_sent, self.response_id
        )
        await self.abort(why)
        await self.close()
        self._mesh.metrics.retries.labels("decode-migrate").inc()
        if not self.attempts.migrate():
            self.is_finished = True
            return TokenEvent(self.request_id, (), finish_reason="length")
        self._begin_attempt(self.attempts.next_wire_id("m"))
        self._first_deadline = time.monotonic() + self._config.first_token_timeout_s
        await self.subscribe()
        await self._place_and_dispatch(time.monotonic())
        return None

    async def _place_and_dispatch(self, started: float) -> None:
        deadline = self._first_deadline
        self._mesh.metrics.waiting.inc()
        try:
            while True:
                try:
                    self.timer.stamps.place_started_at = time.monotonic()
                    reply = await self._place()
                    break
                except PlacementLostError as exc:
                    # The registry died (or was cut off) holding the placement: ask again, of
                    # the next registry, under a new wire id (the old one may have reserved
                    # blocks: its abort frees them), while the deadline allows.
                    if time.monotonic() >= deadline:
                        raise GatewayTimeoutError(exc.message) from None
                    log.warning("%s; asking again for %s", exc.message, self.response_id)
                    await self._next_attempt("placement lost", "kv-registry")
                except OverloadedError as exc:  # queueing: it waits for room (recovery.py)
                    error = stop_waiting_for_room(
                        exc,
                        no_decode_alive=no_decode_worker(self._mesh.decode_pool, time.monotonic()),
                        left_s=deadline - time.monotonic(),
                        request_id=self.request_id,
                        first_token_timeout_s=self._config.first_token_timeout_s,
                    )
                    if error is not None:
                        raise error from None
                    await asyncio.sleep(room_backoff_s(exc.retry_after_s))
        finally:
            self._mesh.metrics.waiting.dec()
        self._mesh.metrics.place.observe(time.monotonic() - started)
        self.placement = reply
        if reply.local_prefill:  # its prefix is cached there: the decode worker prefills the rest
            self.is_local_prefill = True
        self.timer.stamps.placed_at = time.monotonic()
        self.timer.stamps.local_prefill = self.is_local_prefill
        if self.is_local_prefill:
            return
        # the router holds the decode worker's lease until the first token (placing.py)
        await self._remote.start(
            self._nc,
            self._subjects,
            self.request_id,
            self.attempts.prompt,
            reply,
            lease_ms=self._config.lease_ms,
            left_s=max(0.0, deadline - time.monotonic()),
            queue=self._mesh.prefill_queue,
            router=self._mesh.instance,
        )

    async def _place(self) -> PlaceReply:
        """One placement attempt: OverloadedError when the mesh has no room now."""
        place = PlaceRequest(
            request_id=self.request_id,
            prompt_ids=self.attempts.prompt.prompt_ids,
            sampling=self.attempts.prompt.sampling,
            local_prefill=self.is_local_prefill,
            lease_ms=self._config.lease_ms,
            model_spec=self._mesh.model_spec,
            router=self._mesh.instance,
        )
        if not self._nc.is_connected:
            # NATS is down (restarting, or our link): what we sent now would wait in the
            # client's buffer and reach a registry after we gave up on it. Wait as for room.
            raise OverloadedError("NATS is reconnecting", retry_after_s=0.5)
        self._may_hold_blocks = True
        reply = await ask_registry(
            self._nc, self._subjects, place, self._config.place_timeout_s, self._mesh.registry_pool
        )
        if not reply.ok:
            self._may_hold_blocks = False
            raise placement_refused_error(reply)
        return reply

    async def events(self) -> AsyncIterator[TokenEvent]:
        """TokenEvents until (and including) the one with a finish_reason.

        Raises GatewayTimeoutError when the first token does not come within
        ``first_token_timeout_s`` or a next token within ``token_timeout_s``, MeshError when the
        mesh fails the request."""
        while self._replayed:  # a resumed stream's events so far (adopt)
            yield self._replayed.pop(0)
        while not self.is_finished:
            deadline, what = token_deadline(
                self.attempts.num_events, self._first_deadline, self._last_event_at, self._config
            )
            left = deadline - time.monotonic()
            if left <= 0:
                raise GatewayTimeoutError(
                    f"the mesh did not produce {what} for request {self.request_id}"
                )
            try:
                assert self._sub is not None
                msg = await self._sub.next_msg(timeout=min(left, RECONNECT_SILENCE_S))
            except nats.errors.TimeoutError:
                if self._nc.stats["reconnects"] != self._num_reconnects:
                    final = await self._run_again("NATS reconnected and nothing came since", "nats")
                    if final is not None:
                        yield final
                continue
            except nats.errors.Error as exc:
                raise MeshError(f"lost the token stream of {self.request_id}: {exc}") from None
            try:
                event = self._events.decode(msg.subject, msg.data)
            except MalformedEvent as bad:
                if bad.kind is TokenEvent:
                    raise MeshError(
                        f"a decode worker sent a malformed token event: {bad.error}"
                    ) from None
                if bad.kind is PrefillReport:
                    log.warning("ignoring malformed prefill report: %s", bad.error)
                continue  # a malformed PrefillStarted, or a WorkerGone not the router's own
            if isinstance(event, PrefillReport):
                self._record_report(event)
                continue
            if isinstance(event, PrefillStarted):
                self.prefill_worker = event.worker_id
                continue
            if isinstance(event, WorkerGone):
                if not self.depends_on(event.worker_id):
                    continue
                final = await self._run_again(
                    f"{event.role} worker {event.worker_id} died", event.role
                )
                if final is not None:
                    yield final
                continue
            if event is None:
                continue  # another kind of request event; not the router's business
            if self.is_resumed and self.attempts.arrived_before(event):  # the replay had it
                continue
            why = self.attempts.gap(event)
            if why:
                final = await self._run_again(why, "decode")
                if final is not None:
                    yield final
                continue
            self._last_event_at = time.monotonic()
            if self.attempts.num_events == 0:  # the decode worker's share of the first token
                self.timer.stamps.decode_wait_s = event.wait_s
                self.timer.stamps.decode_prefill_s = event.prefill_s
            self.is_finished = self.attempts.record(event)
            self._remote.stop_renewing()  # the decode worker admitted it: the lease is over
            self.timer.on_tokens(time.monotonic(), len(event.token_ids))
            if event.finish_reason in ("error", "abort"):
                self.is_finished = True
                raise MeshError(
                    f"the mesh ended request {self.request_id} with {event.finish_reason!r}: "
                    f"{event.error or 'no reason given'}"
                )
            yield event

    async def abort(self, reason: str) -> None:
        """Tell prefill and decode to drop the request (idempotent; no-op once finished)."""
        if self.is_finished or self.is_aborted or not self._may_hold_blocks:
            return
        self.is_aborted = True
        self._mesh.metrics.aborts.labels(reason).inc()
        # A job no worker has taken yet can be withdrawn: then its blocks are free at once.
        withdrawn = not self.prefill_worker and await self._remote.withdraw(
            self._nc, self._subjects
        )
        await publish_abort(self._nc, self._subjects, self.request_id, reason, withdrawn)

    def _record_report(self, report: PrefillReport) -> None:
        self._mesh.metrics.record_prefill(report)
        stamps = self.timer.stamps
        stamps.remote_queue_s, stamps.remote_compute_s = report.queue_s, report.compute_s
        stamps.remote_transfer_s = report.exposed_transfer_s


@dataclass(frozen=True, slots=True)
class RouterMesh:
    """What every request of one router shares (the Dispatcher holds it): the NATS connection,
    subjects, config and metrics, the worker pools heard, the model served (only decode workers
    serving ``model_spec`` take a request), the prefill queue's health, and the router's
    ``instance`` (the mesh drops its requests when it dies)."""

    nc: NATS
    subjects: Subjects
    config: RouterConfig
    metrics: RouterMetrics
    prefill_pool: WorkerPool | None = None
    decode_pool: WorkerPool | None = None
    registry_pool: WorkerPool | None = None
    model_spec: str = ""
    prefill_queue: PrefillQueueHealth = field(default_factory=PrefillQueueHealth)
    instance: str = ""
