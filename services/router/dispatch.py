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
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from services.router.config import RouterConfig
from services.router.errors import (
    GatewayTimeoutError,
    MeshError,
    OverloadedError,
    ServiceUnavailableError,
)
from services.router.metrics import RequestTimer, RouterMetrics
from services.router.prompt import Prompt
from shared import protocol, subjects
from shared.prefill_queue import publish_job
from shared.protocol import (
    Abort,
    LeaseRenew,
    PlaceReply,
    PlaceRequest,
    PrefillJob,
    PrefillReport,
    ProtocolError,
    TokenEvent,
)

log = logging.getLogger(__name__)


class MeshRequest:
    """One request in flight on the mesh; iterate ``events()`` for its tokens."""

    def __init__(
        self,
        nc: NATS,
        sub: Subscription,
        config: RouterConfig,
        metrics: RouterMetrics,
        request_id: str,
        prompt: Prompt,
        timer: RequestTimer,
    ) -> None:
        self._nc = nc
        self._sub = sub
        self._config = config
        self._metrics = metrics
        self.request_id = request_id
        self.prompt = prompt
        self.timer = timer
        self.placement: PlaceReply | None = None
        self.is_local_prefill = (
            config.mode == "colocated" or len(prompt.prompt_ids) < config.local_prefill_threshold
        )
        self.is_finished = False  # a TokenEvent with finish_reason arrived
        self.is_aborted = False
        self._may_hold_blocks = False  # a placement was asked for and not refused
        self._renewer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Place the request (waiting in the admission queue while the mesh is full) and, for
        remote prefill, publish its prefill job and keep its lease alive until the first token."""
        started = time.monotonic()
        deadline = started + self._config.first_token_timeout_s
        self._metrics.waiting.value += 1
        try:
            while True:
                try:
                    reply = await self._place()
                    break
                except OverloadedError as exc:
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
            self._metrics.waiting.value -= 1
        self._metrics.place.observe(time.monotonic() - started)
        self.placement = reply
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
            await publish_job(self._nc, protocol.encode(job))
        except nats.errors.Error as exc:
            raise ServiceUnavailableError(f"could not publish the prefill job: {exc}") from None

    async def _renew_lease(self, reply: PlaceReply) -> None:
        """The router holds the lease while it waits: renew it every third of its length, so it
        outlives any queue but not the router (stopped by the first token, abort or close)."""
        renew = protocol.encode(
            LeaseRenew(self.request_id, reply.lease_id, lease_ms=self._config.lease_ms)
        )
        subject = subjects.decode_lease_renew(reply.worker_id)
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
        )
        self._may_hold_blocks = True
        try:
            msg = await self._nc.request(
                subjects.REGISTRY_PLACE,
                protocol.encode(place),
                timeout=self._config.place_timeout_s,
            )
        except nats.errors.NoRespondersError:
            raise ServiceUnavailableError(
                f"no kv-registry answers on {subjects.REGISTRY_PLACE}; start one "
                "(`kvmesh serve kv-registry`) or check --nats-url"
            ) from None
        except nats.errors.TimeoutError:
            raise GatewayTimeoutError(
                f"the kv-registry did not place the request within "
                f"{self._config.place_timeout_s:g}s (--place-timeout-s)"
            ) from None
        except nats.errors.Error as exc:
            raise ServiceUnavailableError(f"NATS is unavailable to the router: {exc}") from None
        try:
            reply = protocol.decode(msg.data, PlaceReply)
        except ProtocolError as exc:
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
        tokens_subject = subjects.request_tokens(self.request_id)
        report_subject = subjects.request_prefill_report(self.request_id)
        first_deadline = time.monotonic() + self._config.first_token_timeout_s
        num_events = 0
        while not self.is_finished:
            if num_events == 0:
                timeout = first_deadline - time.monotonic()
                what = f"the first token within {self._config.first_token_timeout_s:g}s"
            else:
                timeout = self._config.token_timeout_s
                what = f"a next token within {self._config.token_timeout_s:g}s"
            try:
                if timeout <= 0:
                    raise nats.errors.TimeoutError
                msg = await self._sub.next_msg(timeout=timeout)
            except nats.errors.TimeoutError:
                raise GatewayTimeoutError(
                    f"the mesh did not produce {what} for request {self.request_id}"
                ) from None
            except nats.errors.Error as exc:
                raise MeshError(f"lost the token stream of {self.request_id}: {exc}") from None
            if msg.subject == report_subject:
                self._record_report(msg.data)
                continue
            if msg.subject != tokens_subject:
                continue  # another kind of request event; not the router's business
            try:
                event = protocol.decode(msg.data, TokenEvent)
            except ProtocolError as exc:
                raise MeshError(f"a decode worker sent a malformed token event: {exc}") from None
            num_events += 1
            self.stop_renewing()  # the decode worker admitted it: the lease is over
            self.timer.on_tokens(time.monotonic(), len(event.token_ids))
            if event.finish_reason is not None:
                self.is_finished = True
                if event.finish_reason in ("error", "abort"):
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
        self._metrics.aborts.inc(reason)
        try:
            await self._nc.publish(
                subjects.ABORT, protocol.encode(Abort(self.request_id, reason=reason))
            )
        except nats.errors.Error as exc:  # the connection is gone: leases will expire instead
            log.warning("could not publish abort for %s: %s", self.request_id, exc)

    def _record_report(self, data: bytes) -> None:
        try:
            report = protocol.decode(data, PrefillReport)
        except ProtocolError as exc:
            log.warning("ignoring malformed prefill report: %s", exc)
            return
        self._metrics.record_prefill(report)


class Dispatcher:
    """Runs requests on the mesh over one NATS connection."""

    def __init__(self, nc: NATS, config: RouterConfig, metrics: RouterMetrics) -> None:
        self._nc = nc
        self._config = config
        self._metrics = metrics

    @asynccontextmanager
    async def open(
        self, request_id: str, prompt: Prompt, timer: RequestTimer
    ) -> AsyncIterator[MeshRequest]:
        """Place ``prompt`` on the mesh; abort it if the block is left before it finishes."""
        sub = await self._nc.subscribe(subjects.request_events_all(request_id))
        request = MeshRequest(self._nc, sub, self._config, self._metrics, request_id, prompt, timer)
        try:
            await request.start()
            yield request
            await request.abort("router stopped reading")
        except asyncio.CancelledError:
            await request.abort("client disconnected")
            raise
        except GatewayTimeoutError:
            await request.abort("timeout")
            raise
        except BaseException as exc:
            await request.abort(_abort_reason(exc))
            raise
        finally:
            request.stop_renewing()
            await sub.unsubscribe()


def _abort_reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionError):
        return "client disconnected"
    if isinstance(exc, MeshError):
        return "mesh error"
    return "router error"
