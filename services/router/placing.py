"""One attempt's calls to get a request placed: the kv-registry's placement (request/reply), the
prefill job on the JetStream queue, and the decode worker's lease kept alive while it waits
(``RemotePrefill`` holds those two); the abort that drops an attempt.

Each call maps NATS's failures to the router's errors (what to do about them: ``recovery.py``);
``mesh_request.py`` makes the calls and keeps the attempt's state.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from kvmesh.services.router.errors import MeshError, ServiceUnavailableError
from kvmesh.services.router.prompt import Prompt
from kvmesh.services.router.queue_health import PrefillQueueHealth
from kvmesh.services.router.recovery import (
    REGISTRY_RESTART_S,
    PlacementLostError,
    registry_silent_error,
)
from kvmesh.services.router.worker_pool import WorkerPool
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.placement import LeaseRenew, PlaceReply, PlaceRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
from kvmesh.shared.bus.messages.token_streams import Abort
from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError, publish_job, withdraw_job
from kvmesh.shared.config.subjects import Subjects
from nats.aio.client import Client as NATS

log = logging.getLogger(__name__)


async def ask_registry(
    nc: NATS,
    subjects: Subjects,
    place: PlaceRequest,
    timeout_s: float,
    registry_pool: WorkerPool | None,
) -> PlaceReply:
    """Ask the kv-registry to place ``place``: its reply, ok or not. No registry answering is
    a wait (one was heard recently: restarting) or a 503; no answer in ``timeout_s`` is a
    PlacementLostError (asked again); a malformed reply a MeshError."""
    try:
        msg = await nc.request(subjects.REGISTRY_PLACE, encode_message(place), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        pool = registry_pool
        seen = pool is not None and pool.seen_within(time.monotonic(), REGISTRY_RESTART_S)
        raise registry_silent_error(seen, subjects) from None
    except nats.errors.TimeoutError:
        raise PlacementLostError(
            f"the kv-registry did not place the request within {timeout_s:g}s (--place-timeout-s)"
        ) from None
    except nats.errors.Error as exc:
        raise ServiceUnavailableError(f"NATS is unavailable to the router: {exc}") from None
    try:
        return decode_message(msg.data, PlaceReply)
    except MessageError as exc:
        raise MeshError(f"the kv-registry sent a malformed placement: {exc}") from None


async def publish_prefill_job(
    nc: NATS,
    subjects: Subjects,
    request_id: str,
    prompt: Prompt,
    reply: PlaceReply,
    left_s: float,
    queue: PrefillQueueHealth,
    router: str = "",
) -> int:
    """Queue the prefill of ``prompt`` into the blocks ``reply`` reserved on its decode worker;
    the job's sequence in the queue (what an abort withdraws), or a 503. It retries a missing
    queue for as long as ``queue`` allows of the ``left_s`` the request has left, and tells it
    how the publish went. ``router``: the router's instance (the job dies with it)."""
    job = PrefillJob(
        request_id=request_id,
        prompt_ids=prompt.prompt_ids,
        sampling=prompt.sampling,
        decode_worker_id=reply.worker_id,
        lease_id=reply.lease_id,
        descriptor=reply.descriptor,
        rkey=reply.rkey,
        block_addrs=reply.block_addrs,
        block_bytes=reply.block_bytes,
        enqueued_at=time.time(),
        router=router,
        ranks=reply.ranks,
    )
    try:
        seq = await publish_job(
            nc,
            subjects,
            encode_message(job),
            msg_id=request_id,
            retry_for_s=queue.retry_for_s(left_s),
        )
    except PrefillQueueError as exc:
        queue.on_missing(str(exc))
        raise ServiceUnavailableError(f"could not publish the prefill job: {exc}") from None
    except nats.errors.Error as exc:
        raise ServiceUnavailableError(f"could not publish the prefill job: {exc}") from None
    queue.on_stored()
    return seq


async def renew_lease(
    nc: NATS, subjects: Subjects, request_id: str, reply: PlaceReply, lease_ms: int
) -> None:
    """The router holds the lease while it waits: renew it every third of its length, so it
    outlives any queue but not the router (cancelled by the first token, abort or close)."""
    renew = encode_message(LeaseRenew(request_id, reply.lease_id, lease_ms=lease_ms))
    subject = subjects.decode_lease_renew(reply.worker_id)
    while True:
        await asyncio.sleep(lease_ms / 3000)
        try:
            await nc.publish(subject, renew)
        except nats.errors.Error as exc:
            log.warning("could not renew the lease of %s: %s", request_id, exc)


class RemotePrefill:
    """An attempt's remote prefill as the router holds it: the decode worker's lease renewed
    until the first token, and the prefill job's sequence in the queue (what an abort withdraws
    while no prefill worker has taken the job)."""

    def __init__(self) -> None:
        self._renewer: asyncio.Task[None] | None = None
        self.job_seq = 0  # 0: no job published

    async def start(
        self,
        nc: NATS,
        subjects: Subjects,
        request_id: str,
        prompt: Prompt,
        reply: PlaceReply,
        *,
        lease_ms: int,
        left_s: float,
        queue: PrefillQueueHealth,
        router: str,
    ) -> None:
        """Keep the lease ``reply`` gave alive, then queue the prefill job (a 503 if it cannot)."""
        renewal = renew_lease(nc, subjects, request_id, reply, lease_ms)
        self._renewer = asyncio.create_task(renewal)
        self.job_seq = await publish_prefill_job(
            nc, subjects, request_id, prompt, reply, left_s=left_s, queue=queue, router=router
        )

    def stop_renewing(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None

    async def withdraw(self, nc: NATS, subjects: Subjects) -> bool:
        """Take the job off the queue (its blocks are free at once); False if there was none or
        a prefill worker had it already."""
        return self.job_seq > 0 and await withdraw_job(nc, subjects, self.job_seq)


async def publish_abort(
    nc: NATS, subjects: Subjects, request_id: str, reason: str, job_withdrawn: bool
) -> None:
    """Tell prefill and decode to drop attempt ``request_id``; a lost connection is logged (the
    leases expire instead)."""
    try:
        abort = Abort(request_id, reason=reason, job_withdrawn=job_withdrawn)
        await nc.publish(subjects.ABORT, encode_message(abort))
    except nats.errors.Error as exc:
        log.warning("could not publish abort for %s: %s", request_id, exc)
