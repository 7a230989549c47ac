"""A prefill job's reservation of a draft worker's blocks for its prompt's draft KV, the NATS side
of the draft-KV feature (draft_writes.py; docs/speculative.md): asked on ``DRAFT_KV_RESERVE``
when the job arrives, answered within ``DRAFT_KV_TIMEOUT_S`` or not at all (the job never waits
for it), and given back on ``draft_kv_done(draft worker)`` as "not written" when the job wrote
nothing there, rather than when its lease runs out."""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.drafts import DraftKvReserve, DraftKvReserveReply
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client

log = logs.get_logger(__name__)

DRAFT_KV_TIMEOUT_S = 0.25  # a draft worker's answer to a prompt-KV reservation, at most
DRAFT_KV_LEASE_S = 30.0  # its blocks wait this long for the prefill's announcement

Reservation = asyncio.Future[DraftKvReserveReply | None]


class DraftReservations:
    def __init__(self, nc: Client, subjects: Subjects, kv_spec: str, draft_kv_spec: str) -> None:
        """``kv_spec``: this worker's (the target's) KV layout; ``draft_kv_spec``: its draft
        model's ("": none here), which a model draft worker checks a reservation against."""
        self.nc = nc
        self.subjects = subjects
        self.kv_spec = kv_spec
        self.draft_kv_spec = draft_kv_spec
        self._releases: set[asyncio.Task[None]] = set()

    def ask(self, msg: PrefillJob) -> Reservation:
        """The reservation for ``msg``'s prompt, asked for now; its answer comes later."""
        return asyncio.ensure_future(self._reserve(msg))

    async def _reserve(self, msg: PrefillJob) -> DraftKvReserveReply | None:
        """A draft worker's blocks for the prompt's draft KV; None when none answers in
        ``DRAFT_KV_TIMEOUT_S`` (the job goes on without draft writes)."""
        req = DraftKvReserve(
            msg.request_id,
            msg.lease_id,
            msg.prompt_ids,
            self.kv_spec,
            lease_ms=int(DRAFT_KV_LEASE_S * 1000),
            draft_kv_spec=self.draft_kv_spec,
        )
        try:
            answer = await self.nc.request(
                self.subjects.DRAFT_KV_RESERVE, encode_message(req), timeout=DRAFT_KV_TIMEOUT_S
            )
            reply = decode_message(answer.data, DraftKvReserveReply)
        except (nats.errors.Error, MessageError) as exc:  # no draft worker (or a slow one)
            log.debug("no draft kv reservation", error=str(exc) or type(exc).__name__)
            return None
        if not reply.ok:
            log.debug("draft kv reservation refused", error=reply.error)
        return reply

    def release(self, msg: PrefillJob, reservation: Reservation) -> None:
        """Give back a reservation the job never wrote into (refused, or stopped before its
        first chunk), once it is answered; nothing waits for it."""
        task = asyncio.ensure_future(self._release(msg, reservation))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, msg: PrefillJob, reservation: Reservation) -> None:
        reply = await reservation
        if reply is None or not reply.ok:
            return
        done = PrefillDone(
            msg.request_id, msg.lease_id, False, error="not written", rkey=reply.rkey
        )
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(
                self.subjects.draft_kv_done(reply.worker_id), encode_message(done)
            )

    async def aclose(self) -> None:
        """Wait for the releases under way (the NATS client closes after)."""
        if self._releases:
            await asyncio.gather(*self._releases, return_exceptions=True)
