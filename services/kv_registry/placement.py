"""The kv-registry's placement: answers PlaceRequest on REGISTRY_PLACE.

``RegistryState.choose`` (the pure policy of placement_policy.py, prefix- and store-aware) picks
a decode worker; this asks that worker to reserve the blocks (ReserveRequest on
``decode_reserve(worker)``) and, once it has, records the lease (``RegistryState.grant``) and
replies with the block addresses. A refused or silent worker is skipped for the next candidate,
up to ``max_reserve_attempts``.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
import orjson
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.metrics import RegistryMetrics
from kvmesh.services.kv_registry.placement_policy import Candidate, Refusal
from kvmesh.services.kv_registry.waiting_line import WaitingLine
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.placement import (
    LeaseCancel,
    PlaceReply,
    PlaceRequest,
    ReserveReply,
    ReserveRequest,
)
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.micro.request import ERROR_HEADER, Request

log = logs.get_logger(__name__)


@dataclass(eq=False)
class Placement:
    """Places requests on decode workers (each ``answer`` runs in a task of its own: the
    reservations wait on decode workers, and one slow worker must not hold up the others)."""

    config: RegistryConfig
    nc: Client
    subjects: Subjects
    core: RegistryState
    metrics: RegistryMetrics
    clock: Callable[[], float] = time.monotonic
    line: WaitingLine = field(default_factory=WaitingLine)  # placements waiting for room

    async def answer(self, req: Request) -> None:
        """Reply to one PlaceRequest (a malformed one gets a refusal naming the problem)."""
        started = time.perf_counter()
        try:
            request = decode_message(req.data, PlaceRequest)
        except MessageError as exc:
            reply = PlaceReply(ok=False, request_id=_request_id_of(req.data), error=str(exc))
            refusal, local_prefill = "malformed", False
        else:
            with logs.request_context(request.request_id):
                reply, refusal = await self.place(request)
            local_prefill = request.local_prefill or reply.local_prefill
        self.metrics.observe_place(
            time.perf_counter() - started,
            local_prefill=local_prefill,
            refusal=refusal,
            cached_tokens=reply.cached_tokens,
        )
        await req.respond(encode_message(reply))

    async def place(self, request: PlaceRequest) -> tuple[PlaceReply, str]:
        """The reply, and why it is a refusal ("" when placed; RegistryMetrics' reasons)."""
        tried: set[str] = set()
        errors: list[str] = []
        now = self.clock()
        head = self.line.head_before(request.request_id, now)
        held_tokens = head.num_tokens if head is not None else 0
        for _ in range(self.config.max_reserve_attempts):
            choice = self.core.choose(request, self.clock(), frozenset(tried), held_tokens)
            if isinstance(choice, Refusal):
                if not tried:
                    log.debug("refused", reason=choice.reason, error=choice.error)
                    if choice.reason == "full":  # it keeps its place in the line
                        self.line.wait(request.request_id, len(request.prompt_ids), now)
                    else:
                        self.line.leave(request.request_id)
                    return _refused(request, choice.error, choice.retry_after_s), choice.reason
                break
            tried.add(choice.worker_id)
            lease_id = uuid.uuid4().hex
            reply = await self._reserve(choice, request, lease_id)
            if reply.ok:
                self.metrics.store_matched_tokens.inc(choice.store_cached_tokens)
                if choice.read_tokens:
                    self.metrics.store_read_placements.inc()
                placed = self.core.grant(
                    choice,
                    request,
                    lease_id,
                    reply.block_ids,
                    self.clock(),
                    reply.rkey,
                    reply.block_addrs,
                    reply.ranks,
                )
                log.debug(
                    "placed",
                    worker_id=choice.worker_id,
                    num_blocks=len(reply.block_ids),
                    local_prefill=choice.is_local_prefill(request),
                    cached_tokens=choice.cached_tokens,
                    store_cached_tokens=choice.store_cached_tokens,
                    read_tokens=choice.read_tokens,
                )
                self.line.leave(request.request_id)
                return placed, "" if placed.ok else "worker_gone"
            self.core.release_inflight(choice)
            errors.append(f"{choice.worker_id}: {reply.error}")
        log.debug("refused", reason="reserve_failed", errors=errors)
        self.line.wait(request.request_id, len(request.prompt_ids), now)
        return _refused(
            request,
            f"no decode worker accepted the request ({'; '.join(errors)})",
            self.config.retry_after_s,
        ), "reserve_failed"

    async def _reserve(
        self, choice: Candidate, request: PlaceRequest, lease_id: str
    ) -> ReserveReply:
        body = ReserveRequest(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            sampling=request.sampling,
            local_prefill=choice.is_local_prefill(request),
            lease_id=lease_id,
            lease_ms=request.lease_ms,
            router=request.router,
        )
        refuse = lambda error: ReserveReply(ok=False, worker_id=choice.worker_id, error=error)
        try:
            msg = await self.nc.request(
                self.subjects.decode_reserve(choice.worker_id),
                encode_message(body),
                timeout=self.config.reserve_timeout_s,
            )
        except nats.errors.NoRespondersError:
            return refuse("not listening for reservations")
        except nats.errors.TimeoutError:
            # It may reserve once it gets to the request (a worker that was stopped, or slow):
            # the request is placed elsewhere, so tell it to free (or refuse) that reservation.
            error = f"no reserve reply within {self.config.reserve_timeout_s:g}s"
            cancel = LeaseCancel(request.request_id, lease_id, reason=error)
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(
                    self.subjects.decode_lease_cancel(choice.worker_id),
                    encode_message(cancel),
                )
            return refuse(error)
        if msg.headers and ERROR_HEADER in msg.headers:
            return refuse(msg.headers[ERROR_HEADER])
        try:
            reply = decode_message(msg.data, ReserveReply)
        except MessageError as exc:
            return refuse(f"malformed reserve reply: {exc}")
        if reply.ok and reply.worker_id != choice.worker_id:
            return refuse(f"reply names worker {reply.worker_id!r}")
        if reply.ok and len(reply.block_addrs) != len(reply.block_ids):
            return refuse(
                f"reply names {len(reply.block_ids)} blocks but {len(reply.block_addrs)} addresses"
            )
        if reply.ok:
            for rank, target in enumerate(reply.ranks, start=1):
                if len(target.block_addrs) != len(reply.block_ids):
                    return refuse(
                        f"reply names {len(reply.block_ids)} blocks but {len(target.block_addrs)} "
                        f"addresses on tensor-parallel rank {rank}"
                    )
        return reply


def _refused(request: PlaceRequest, error: str, retry_after_s: float) -> PlaceReply:
    return PlaceReply(
        ok=False, request_id=request.request_id, error=error, retry_after_s=retry_after_s
    )


def _request_id_of(data: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError):
        raw = orjson.loads(data)
        if isinstance(raw, dict) and isinstance(raw.get("request_id"), str):
            return raw["request_id"]
    return ""
