"""The NATS side of one request: place -> prefill job -> token relay -> abort.

``Dispatcher.open`` subscribes to the request's event subjects before anything is sent (so no
token can be missed), asks the kv-registry for a placement, publishes the prefill job unless the
decode worker prefills locally, and yields a ``MeshRequest`` whose ``events()`` relays TokenEvents
until one carries a finish_reason. Leaving the block early, by an error, a timeout or a
cancellation (the client went away), publishes ``Abort`` so prefill stops and the reserved blocks
go back. Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import nats.errors
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import (
    ClientGoneError,
    GatewayTimeoutError,
    MeshError,
    OverloadedError,
    ServiceUnavailableError,
)
from kvmesh.services.router.metrics import RequestTimer, RouterMetrics
from kvmesh.services.router.pool_capacity import PoolCapacity
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared import protocol
from kvmesh.shared.hearing import Hearing
from kvmesh.shared.prefill_queue import PrefillQueueError, publish_job, withdraw_job
from kvmesh.shared.protocol import (
    Abort,
    DecodeAdvert,
    LeaseRenew,
    MessageError,
    PlaceReply,
    PlaceRequest,
    PrefillJob,
    PrefillReport,
    PrefillStarted,
    TokenEvent,
    WorkerGone,
    WorkerHeartbeat,
)
from kvmesh.shared.sampling import SamplingOptions
from kvmesh.shared.subjects import Subjects
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger(__name__)


# A kv-registry heard this recently and not answering now is restarting (its supervisor brings it
# back in seconds): placements wait for it, within the request's first-token deadline, instead
# of failing. One never heard, or gone longer, is missing: a 503 at once.
REGISTRY_RESTART_S = 20.0

# What was published while the router's NATS connection was down is lost to it: its tokens, and
# perhaps its prefill job (a restarted server may come back with an empty JetStream store). A
# request that hears nothing for this long after a reconnect runs again: from the start before
# its first token, else it migrates. A lost token among ones that do arrive shows as a gap in
# the events' token counts, and the stream migrates at once.
RECONNECT_SILENCE_S = 1.0


class MeshRequest:
    """One request in flight on the mesh; iterate ``events()`` for its tokens."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: RouterConfig,
        metrics: RouterMetrics,
        request_id: str,
        prompt: Prompt,
        timer: RequestTimer,
        prefill_pool: WorkerPool | None = None,
        decode_pool: WorkerPool | None = None,
        registry_pool: WorkerPool | None = None,
        model_spec: str = "",
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._model_spec = model_spec  # only decode workers serving this model take the request
        self._sub: Subscription | None = None
        self._prefill_pool = prefill_pool
        self._decode_pool = decode_pool
        self._registry_pool = registry_pool
        self._lost: set[str] = set()  # workers whose loss also loses this request
        self._config = config
        self._metrics = metrics
        self.response_id = request_id  # what the client sees; constant across attempts
        self.num_attempts = 1  # wire ids used: <id>, then <id>-r1 / -m2 ... in one sequence
        self.num_runs_again = 0  # of them, runs again after a failure (--max-retries counts)
        self.num_events = 0  # token events of the current attempt
        self.num_accepted_drafts = 0  # of the tokens relayed, accepted drafts (all attempts)
        self.prompt = prompt  # of the current attempt: a migrated one carries the output so far
        self._generated: list[int] = []  # every token the client has been sent, all attempts
        self._migrated_tokens = 0  # of those, how many the current attempt's prompt carries
        # n > 1: tokens per choice (of this attempt: they never migrate) and the finished ones
        self._choice_tokens: dict[int, int] = {}
        self._finished_choices: set[int] = set()
        self.timer = timer
        self.is_finished = False  # a TokenEvent with finish_reason arrived
        self._renewer: asyncio.Task[None] | None = None
        self._first_deadline = 0.0  # set by start(); every attempt shares it
        self._last_event_at = 0.0  # of the last token event: the next-token timeout runs from it
        self._begin_attempt(request_id)

    def _begin_attempt(self, wire_id: str) -> None:
        """Fresh per-attempt state: the wire id (retries get -r1, -r2, ...) and nothing placed."""
        self.request_id = wire_id
        self.placement: PlaceReply | None = None
        self.prefill_worker = ""  # from its PrefillStarted
        self._job_seq = 0  # the prefill job's sequence in the queue (0: none published)
        self._lost.clear()
        self.is_local_prefill = self._choose_local_prefill()
        self.is_aborted = False
        self._may_hold_blocks = False  # a placement was asked for and not refused
        self._num_reconnects = self._nc.stats["reconnects"]  # NATS reconnects before this attempt

    def _choose_local_prefill(self) -> bool:
        if self._config.mode == "colocated":
            return True
        if len(self.prompt.prompt_ids) < self._config.local_prefill_threshold:
            return True
        # no prefill worker ready: the decode worker prefills rather than the job waiting
        pool, now = self._prefill_pool, time.monotonic()
        return pool is not None and pool.is_known(now) and pool.num_ready(now) == 0

    def mark_lost(self, worker_id: str) -> None:
        """Losing ``worker_id`` loses this request too (e.g. the last prefill worker went while
        its job waited in the queue)."""
        self._lost.add(worker_id)

    async def subscribe(self) -> None:
        """Listen on this attempt's event subjects (before anything is sent: no token is missed)."""
        self._sub = await self._nc.subscribe(self._subjects.request_events_all(self.request_id))

    async def close(self) -> None:
        self.stop_renewing()
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
        return self.num_events == 0 and self.prefill_worker == worker_id

    async def start(self) -> None:
        """Place the request (waiting in the admission queue while the mesh is full) and, for
        remote prefill, publish its prefill job and keep its lease alive until the first token."""
        started = time.monotonic()
        self._first_deadline = started + self._config.first_token_timeout_s
        await self._place_and_dispatch(started)

    async def _run_again(self, why: str, role: str) -> TokenEvent | None:
        """Something this request depended on failed (``why``): run it again, from the start
        before its first token, else by migrating the stream; a MeshError once --max-retries
        runs are spent. Returns the final event when nothing is owed any more."""
        if self.num_runs_again >= self._config.max_retries:
            raise MeshError(
                f"{why} while serving request {self.response_id} ({self.num_events} token "
                f"events in, attempt {self.num_attempts}; --max-retries spent)"
            )
        self.num_runs_again += 1
        if self.num_events == 0:
            await self._retry(why, role)
            return None
        unmovable = _why_not_migrated(self.prompt.sampling)
        if unmovable:
            raise MeshError(
                f"{why} while serving request {self.response_id} after its first tokens; a "
                f"request {unmovable} is not migrated (send it again)"
            )
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
        self._metrics.retries.labels(role).inc()
        self._begin_attempt(f"{self.response_id}-r{self.num_attempts}")
        self.num_attempts += 1
        await self.subscribe()

    async def _migrate(self, why: str) -> TokenEvent | None:
        """The stream broke (its decode worker died, or its tokens were lost): place the request
        again with its prompt plus the tokens sent so far as the new prompt, for the tokens still
        owed, under a new wire id; the client's stream goes on from there (greedy output is what
        an undisturbed run gives). Returns the final event when nothing is owed any more (the
        finish event was lost)."""
        generated = tuple(self._generated)
        made = len(generated) - self._migrated_tokens  # by the attempt that broke
        owed = self.prompt.sampling.max_tokens - made
        log.warning(
            "%s after %d tokens of %s; migrating the stream", why, len(generated), self.response_id
        )
        await self.abort(why)
        await self.close()
        self._metrics.retries.labels("decode-migrate").inc()
        if owed <= 0:
            self.is_finished = True
            return TokenEvent(self.request_id, (), finish_reason="length")
        base = self.prompt.prompt_ids[: len(self.prompt.prompt_ids) - self._migrated_tokens]
        # The output so far becomes prompt: its tokens still count for repetition_penalty, no
        # longer for the frequency and presence penalties (vLLM's output-only counts).
        sampling = msgspec.structs.replace(
            self.prompt.sampling,
            max_tokens=owed,
            min_tokens=max(0, self.prompt.sampling.min_tokens - made),
            prompt_logprobs=None,  # the first attempt scored the prompt; this one's is longer
        )
        self.prompt = Prompt(base + generated, sampling)
        self._migrated_tokens = len(generated)
        self._begin_attempt(f"{self.response_id}-m{self.num_attempts}")
        self.num_attempts += 1
        self.num_events = 0
        self._first_deadline = time.monotonic() + self._config.first_token_timeout_s
        await self.subscribe()
        await self._place_and_dispatch(time.monotonic())
        return None

    async def _place_and_dispatch(self, started: float) -> None:
        deadline = self._first_deadline
        self._metrics.waiting.inc()
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
                except OverloadedError as exc:
                    pool, now = self._decode_pool, time.monotonic()
                    if pool is not None and pool.is_known(now) and pool.num_alive(now) == 0:
                        # "no workers at all" is not "at capacity": say so instead of waiting
                        raise ServiceUnavailableError(
                            "no decode worker is alive (none heartbeats); start one (`kvmesh "
                            "serve decode`) or check the mesh with `kvmesh admin workers`",
                            retry_after_s=exc.retry_after_s or 1.0,
                        ) from None
                    # Overload is queueing: an accepted request waits for room, it does not fail.
                    left = deadline - time.monotonic()
                    if left <= exc.retry_after_s:
                        raise GatewayTimeoutError(
                            f"the mesh had no room for request {self.request_id} within "
                            f"{self._config.first_token_timeout_s:g}s (--first-token-timeout-s); "
                            f"last answer: {exc.message}"
                        ) from None
                    await asyncio.sleep(min(exc.retry_after_s, 0.5) * (0.5 + random.random()))
        finally:
            self._metrics.waiting.dec()
        self._metrics.place.observe(time.monotonic() - started)
        self.placement = reply
        if reply.local_prefill:  # its prefix is cached there: the decode worker prefills the rest
            self.is_local_prefill = True
        self.timer.stamps.placed_at = time.monotonic()
        self.timer.stamps.local_prefill = self.is_local_prefill
        if self.is_local_prefill:
            return
        job = PrefillJob(
            request_id=self.request_id,
            prompt_ids=self.prompt.prompt_ids,
            sampling=self.prompt.sampling,
            decode_worker_id=reply.worker_id,
            lease_id=reply.lease_id,
            descriptor=reply.descriptor,
            rkey=reply.rkey,
            block_addrs=reply.block_addrs,
            block_bytes=reply.block_bytes,
            enqueued_at=time.time(),
        )
        self._renewer = asyncio.create_task(self._renew_lease(reply))
        try:
            self._job_seq = await publish_job(
                self._nc,
                self._subjects,
                protocol.encode_message(job),
                msg_id=self.request_id,
                retry_for_s=max(0.0, deadline - time.monotonic()),
            )
        except (nats.errors.Error, PrefillQueueError) as exc:
            raise ServiceUnavailableError(f"could not publish the prefill job: {exc}") from None

    async def _renew_lease(self, reply: PlaceReply) -> None:
        """The router holds the lease while it waits: renew it every third of its length, so it
        outlives any queue but not the router (stopped by the first token, abort or close)."""
        renew = protocol.encode_message(
            LeaseRenew(self.request_id, reply.lease_id, lease_ms=self._config.lease_ms)
        )
        subject = self._subjects.decode_lease_renew(reply.worker_id)
        while True:
            await asyncio.sleep(self._config.lease_ms / 3000)
            try:
                await self._nc.publish(subject, renew)
            except nats.errors.Error as exc:
                log.warning("could not renew the lease of %s: %s", self.request_id, exc)

    def stop_renewing(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def _place(self) -> PlaceReply:
        """One placement attempt: OverloadedError when the mesh has no room now."""
        place = PlaceRequest(
            request_id=self.request_id,
            prompt_ids=self.prompt.prompt_ids,
            sampling=self.prompt.sampling,
            local_prefill=self.is_local_prefill,
            lease_ms=self._config.lease_ms,
            model_spec=self._model_spec,
        )
        if not self._nc.is_connected:
            # NATS is down (restarting, or our link): what we sent now would wait in the
            # client's buffer and reach a registry after we gave up on it. Wait as for room.
            raise OverloadedError("NATS is reconnecting", retry_after_s=0.5)
        self._may_hold_blocks = True
        try:
            msg = await self._nc.request(
                self._subjects.REGISTRY_PLACE,
                protocol.encode_message(place),
                timeout=self._config.place_timeout_s,
            )
        except nats.errors.NoRespondersError:
            pool = self._registry_pool
            if pool is not None and pool.seen_within(time.monotonic(), REGISTRY_RESTART_S):
                # it was here a moment ago: it is restarting, so wait for it as for room
                raise OverloadedError(
                    "the kv-registry is not answering (restarting?)", retry_after_s=0.5
                ) from None
            raise ServiceUnavailableError(
                f"no kv-registry answers on {self._subjects.REGISTRY_PLACE}; start one for mesh "
                f"{self._subjects.mesh} (`kvmesh serve kv-registry --mesh "
                f"{self._subjects.mesh}`) or check --nats-url"
            ) from None
        except nats.errors.TimeoutError:
            raise PlacementLostError(
                f"the kv-registry did not place the request within "
                f"{self._config.place_timeout_s:g}s (--place-timeout-s)"
            ) from None
        except nats.errors.Error as exc:
            raise ServiceUnavailableError(f"NATS is unavailable to the router: {exc}") from None
        try:
            reply = protocol.decode_message(msg.data, PlaceReply)
        except MessageError as exc:
            raise MeshError(f"the kv-registry sent a malformed placement: {exc}") from None
        if not reply.ok:
            self._may_hold_blocks = False
            if reply.retry_after_s > 0:
                raise OverloadedError(
                    f"the mesh is at capacity ({reply.error or 'no free KV blocks'}); "
                    f"retry after {reply.retry_after_s:g}s",
                    retry_after_s=reply.retry_after_s,
                )
            raise ServiceUnavailableError(
                f"the kv-registry could not place the request: {reply.error or 'no reason given'}"
            )
        return reply

    async def events(self) -> AsyncIterator[TokenEvent]:
        """TokenEvents until (and including) the one with a finish_reason.

        Raises GatewayTimeoutError when the first token does not come within
        ``first_token_timeout_s`` or a next token within ``token_timeout_s``, MeshError when the
        mesh fails the request."""
        while not self.is_finished:
            tokens_subject = self._subjects.request_tokens(self.request_id)
            report_subject = self._subjects.request_prefill_report(self.request_id)
            if self.num_events == 0:
                deadline = self._first_deadline
                what = f"the first token within {self._config.first_token_timeout_s:g}s"
            else:
                deadline = self._last_event_at + self._config.token_timeout_s
                what = f"a next token within {self._config.token_timeout_s:g}s"
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
            if msg.subject == report_subject:
                self._record_report(msg.data)
                continue
            if msg.subject == self._subjects.request_prefill_started(self.request_id):
                with contextlib.suppress(MessageError):
                    self.prefill_worker = protocol.decode_message(
                        msg.data, PrefillStarted
                    ).worker_id
                continue
            if msg.subject == self._subjects.request_worker_gone(self.request_id):
                try:
                    gone = protocol.decode_message(msg.data, WorkerGone)
                except MessageError:  # not the router's own: ignored
                    continue
                if not self.depends_on(gone.worker_id):
                    continue
                final = await self._run_again(
                    f"{gone.role} worker {gone.worker_id} died", gone.role
                )
                if final is not None:
                    yield final
                continue
            if msg.subject != tokens_subject:
                continue  # another kind of request event; not the router's business
            try:
                event = protocol.decode_message(msg.data, TokenEvent)
            except MessageError as exc:
                raise MeshError(f"a decode worker sent a malformed token event: {exc}") from None
            received = self._choice_tokens.get(event.index, 0)
            if self.prompt.sampling.n == 1:
                received = len(self._generated) - self._migrated_tokens
            if _is_gap(event, received):
                why = (
                    f"token events were lost (the decode worker counts {event.num_output_tokens} "
                    f"tokens of choice {event.index}, {received} arrived before)"
                )
                final = await self._run_again(why, "decode")
                if final is not None:
                    yield final
                continue
            self.num_events += 1
            self._last_event_at = time.monotonic()
            if self.num_events == 1:  # the decode worker's share of the time to first token
                self.timer.stamps.decode_wait_s = event.wait_s
                self.timer.stamps.decode_prefill_s = event.prefill_s
            self._generated.extend(event.token_ids)
            self._choice_tokens[event.index] = received + len(event.token_ids)
            self.num_accepted_drafts += event.num_accepted_drafts
            self.stop_renewing()  # the decode worker admitted it: the lease is over
            self.timer.on_tokens(time.monotonic(), len(event.token_ids))
            if event.finish_reason is not None:
                self._finished_choices.add(event.index)
                self.is_finished = len(self._finished_choices) >= self.prompt.sampling.n
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
        self._metrics.aborts.labels(reason).inc()
        # A job no worker has taken yet can be withdrawn: then its blocks are free at once.
        withdrawn = (
            self._job_seq > 0
            and not self.prefill_worker
            and await withdraw_job(self._nc, self._subjects, self._job_seq)
        )
        try:
            abort = Abort(self.request_id, reason=reason, job_withdrawn=withdrawn)
            await self._nc.publish(self._subjects.ABORT, protocol.encode_message(abort))
        except nats.errors.Error as exc:  # the connection is gone: leases will expire instead
            log.warning("could not publish abort for %s: %s", self.request_id, exc)

    def _record_report(self, data: bytes) -> None:
        try:
            report = protocol.decode_message(data, PrefillReport)
        except MessageError as exc:
            log.warning("ignoring malformed prefill report: %s", exc)
            return
        self._metrics.record_prefill(report)
        stamps = self.timer.stamps
        stamps.remote_queue_s, stamps.remote_compute_s = report.queue_s, report.compute_s
        stamps.remote_transfer_s = report.exposed_transfer_s


class Dispatcher:
    """Runs requests on the mesh over one NATS connection."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: RouterConfig,
        metrics: RouterMetrics,
        model_spec: str = "",
        hearing: Hearing | None = None,
    ) -> None:
        """``hearing``: the NATS connection's outages (connect_nats tells it); the worker pools
        count no silence during one."""
        self._nc = nc
        self._subjects = subjects
        self._model_spec = model_spec
        self._config = config
        self._metrics = metrics
        self._live: dict[str, MeshRequest] = {}
        self.is_stopping = False  # the router is shutting down: a cancellation is not the client
        now = time.monotonic()
        hearing = hearing or Hearing(connected_since=now)
        self.prefill_pool = WorkerPool(config.worker_liveness_s, now, hearing)
        self.decode_pool = WorkerPool(config.worker_liveness_s, now, hearing)  # or colocated
        self.registry_pool = WorkerPool(config.worker_liveness_s, now, hearing)
        self.capacity = PoolCapacity(model_spec)  # the decode workers' KV pools, by adverts

    async def on_heartbeat(self, msg: Msg) -> None:
        """Prefill, decode and colocated heartbeats: who is alive and ready."""
        try:
            beat = protocol.decode_message(msg.data, WorkerHeartbeat)
        except MessageError:
            return
        pools = {"prefill": self.prefill_pool, "kv-registry": self.registry_pool}
        pool = pools.get(beat.role, self.decode_pool)
        pool.on_heartbeat(beat.worker_id, beat.state, time.monotonic())

    async def on_advert(self, msg: Msg) -> None:
        """Decode adverts: the refusal counters each decode worker reports, for /metrics."""
        try:
            advert = protocol.decode_message(msg.data, DecodeAdvert)
        except MessageError:
            return
        self._metrics.record_advert(advert)
        self.capacity.note(advert, time.monotonic())

    async def on_worker_gone(self, msg: Msg) -> None:
        """The registry dropped a worker: every request that depended on it hears it now, in its
        own event stream (it retries before its first token, fails after)."""
        try:
            gone = protocol.decode_message(msg.data, WorkerGone)
        except MessageError:
            return
        self._metrics.forget_worker(gone.worker_id)
        self.capacity.forget(gone.worker_id)
        self.decode_pool.on_gone(gone.worker_id)
        if gone.role == "prefill":
            self.prefill_pool.on_gone(gone.worker_id)
            if self.prefill_pool.num_ready(time.monotonic()) == 0:
                # the last one: queued jobs will never be taken; run them with local prefill
                for request in self._live.values():
                    if not request.is_local_prefill and request.num_events == 0:
                        request.mark_lost(gone.worker_id)
        for request in list(self._live.values()):
            if request.depends_on(gone.worker_id):
                with contextlib.suppress(nats.errors.Error):
                    await self._nc.publish(
                        self._subjects.request_worker_gone(request.request_id), msg.data
                    )

    @asynccontextmanager
    async def open(
        self, request_id: str, prompt: Prompt, timer: RequestTimer
    ) -> AsyncIterator[MeshRequest]:
        """Place ``prompt`` on the mesh; abort it if the block is left before it finishes."""
        request = MeshRequest(
            self._nc,
            self._subjects,
            self._config,
            self._metrics,
            request_id,
            prompt,
            timer,
            self.prefill_pool,
            self.decode_pool,
            self.registry_pool,
            self._model_spec,
        )
        self._live[request_id] = request
        try:
            await request.subscribe()
            await request.start()
            yield request
            await request.abort("router stopped reading")
        except asyncio.CancelledError:
            await request.abort("router stopping" if self.is_stopping else "client disconnected")
            raise
        except GatewayTimeoutError:
            await request.abort("timeout")
            raise
        except BaseException as exc:
            await request.abort(_abort_reason(exc))
            raise
        finally:
            del self._live[request_id]
            await request.close()


def _why_not_migrated(sampling: SamplingOptions) -> str:
    """What keeps a request that has streamed tokens from migrating ("" if nothing): a migrated
    attempt takes the output so far as prompt, which n > 1 choices cannot share, and which a
    structured output's grammar would start over after."""
    if sampling.n > 1:
        return "of n > 1 choices"
    if sampling.structured_outputs is not None:
        return "with a structured output (its grammar cannot resume mid-output)"
    return ""


class PlacementLostError(GatewayTimeoutError):
    """No answer to a placement within --place-timeout-s: the registry died or was cut off
    holding it. It is asked again (of the next registry) within the request's deadline."""


def _is_gap(event: TokenEvent, num_received: int) -> bool:
    """Whether ``event`` says its attempt made more (or fewer) tokens than the ``num_received``
    that arrived before it plus its own: a token event was lost on the way (0: not counted)."""
    if event.num_output_tokens == 0 or event.finish_reason in ("error", "abort"):
        return False
    return event.num_output_tokens != num_received + len(event.token_ids)


def _abort_reason(exc: BaseException) -> str:
    if isinstance(exc, ClientGoneError):
        return exc.reason
    if isinstance(exc, ConnectionError):
        return "client disconnected"
    if isinstance(exc, MeshError):
        return "mesh error"
    return "router error"
