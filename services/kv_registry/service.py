"""The kv-registry's NATS shell around ``core.RegistryState``.

In (its mesh's ``Subjects``): DecodeAdvert on REGISTRY_ADVERTISE, WorkerHeartbeat on
HEARTBEAT_ALL, PrefillDone on ``decode_prefill_done(*)`` (ends a lease), PlaceRequest on
REGISTRY_PLACE and the admin subjects.
Out: ReserveRequest to ``decode_reserve(worker)``, WorkerControl to ``worker_control(worker)``,
LogLevel on CONTROL_LOG_LEVEL. Admin bodies are plain JSON; errors are ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import nats.errors
import orjson
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.core import Candidate, Refusal, RegistryState
from kvmesh.services.kv_registry.metrics import RegistryMetrics
from kvmesh.shared import logs, protocol
from kvmesh.shared.metrics_exporter import serve_metrics
from kvmesh.shared.nats_service import (
    connect_nats,
    new_worker_id,
    serve_until_signal,
    subscriptions,
    worker_presence,
)
from kvmesh.shared.prefill_queue import queue_status
from kvmesh.shared.protocol import (
    DecodeAdvert,
    LeaseRenew,
    LogLevel,
    MessageError,
    PlaceReply,
    PlaceRequest,
    PrefillDone,
    ReserveReply,
    ReserveRequest,
    WorkerControl,
    WorkerGone,
    WorkerHeartbeat,
)
from kvmesh.shared.subjects import Subjects
from nats.aio.client import Client
from nats.micro.request import ERROR_HEADER, Request

log = logs.get_logger(__name__)

ROLE = "kv-registry"


class AdminError(ValueError):
    """An admin request the registry cannot carry out; the message goes back as {"error": ...}."""


class RegistryService:
    def __init__(
        self,
        config: RegistryConfig,
        nc: Client,
        tg: asyncio.TaskGroup,
        worker_id: str,
        subjects: Subjects,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.nc = nc
        self.subjects = subjects
        self.tg = tg
        self.worker_id = worker_id
        self.clock = clock
        self.started_at = time.time()
        self.core = RegistryState(
            worker_timeout_s=config.worker_timeout_s,
            missed_heartbeats=config.missed_heartbeats,
            retry_after_s=config.retry_after_s,
            kv_spec=config.kv_spec,
        )
        self.metrics = RegistryMetrics(self.core)
        self.metrics_port: int | None = None  # bound by registry_service (None: no endpoint)
        self._tasks: set[asyncio.Task[None]] = set()

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=ROLE,
            state="ready",
            num_running=len(self.core.leases),
            started_at=self.started_at,
            sent_at=time.time(),
        )

    # --- what the workers publish ---------------------------------------------------------------

    async def on_advert(self, advert: DecodeAdvert) -> None:
        if self.core.observe_advert(advert, self.clock()):
            log.info(
                "decode worker joined",
                worker_id=advert.worker_id,
                mode=advert.mode,
                total_blocks=advert.total_blocks,
                free_blocks=advert.free_blocks,
            )

    async def on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.core.observe_heartbeat(heartbeat, self.clock())

    async def on_prefill_done(self, done: PrefillDone) -> None:
        self.core.complete_lease(done.lease_id)

    async def on_lease_renew(self, renew: LeaseRenew) -> None:
        expires_at = self.clock() + renew.lease_ms / 1000.0
        self.core.renew_lease(renew.lease_id, renew.request_id, expires_at)

    async def expiry_loop(self) -> None:
        interval = min(0.5, self.config.heartbeat_s / 2)
        while True:
            now = self.clock()
            before = {row["worker_id"]: row for row in self.core.workers(now)}
            dropped, expired = self.core.expire(now)
            for worker_id in dropped:
                log.warning("worker dropped: no heartbeat or advert", worker_id=worker_id)
                row = before.get(worker_id, {"role": "?", "last_seen_s": 0.0})
                gone = WorkerGone(worker_id, row["role"], float(row["last_seen_s"]))
                try:  # requests on it fail or move now, not at their timeouts
                    await self.nc.publish(
                        self.subjects.REGISTRY_WORKER_GONE, protocol.encode_message(gone)
                    )
                except nats.errors.Error as exc:
                    log.warning("could not announce a dropped worker", error=str(exc))
            for lease in expired:
                log.info(
                    "lease expired (the decode worker frees its blocks)",
                    lease_id=lease.lease_id,
                    request_id=lease.request_id,
                    worker_id=lease.worker_id,
                )
            await asyncio.sleep(interval)

    # --- placement ------------------------------------------------------------------------------

    async def on_place(self, req: Request) -> None:
        # Reservations wait on decode workers: answer each in its own task so one slow worker
        # does not hold up the subscription.
        self._spawn(self._answer_place(req))

    async def _answer_place(self, req: Request) -> None:
        started = time.perf_counter()
        try:
            request = protocol.decode_message(req.data, PlaceRequest)
        except MessageError as exc:
            reply = PlaceReply(ok=False, request_id=_request_id_of(req.data), error=str(exc))
            refusal, local_prefill = "malformed", False
        else:
            with logs.request_context(request.request_id):
                reply, refusal = await self.place(request)
            local_prefill = request.local_prefill
        self.metrics.observe_place(
            time.perf_counter() - started, local_prefill=local_prefill, refusal=refusal
        )
        await req.respond(protocol.encode_message(reply))

    async def place(self, request: PlaceRequest) -> tuple[PlaceReply, str]:
        """The reply, and why it is a refusal ("" when placed; RegistryMetrics' reasons)."""
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(self.config.max_reserve_attempts):
            choice = self.core.choose(request, self.clock(), frozenset(tried))
            if isinstance(choice, Refusal):
                if not tried:
                    log.debug("refused", reason=choice.reason, error=choice.error)
                    return _refused(request, choice.error, choice.retry_after_s), choice.reason
                break
            tried.add(choice.worker_id)
            lease_id = uuid.uuid4().hex
            reply = await self._reserve(choice, request, lease_id)
            if reply.ok:
                placed = self.core.grant(
                    choice, request, lease_id, reply.block_ids, self.clock(), reply.rkey
                )
                log.debug(
                    "placed",
                    worker_id=choice.worker_id,
                    num_blocks=len(reply.block_ids),
                    local_prefill=request.local_prefill,
                )
                return placed, "" if placed.ok else "worker_gone"
            self.core.release_inflight(choice)
            errors.append(f"{choice.worker_id}: {reply.error}")
        log.debug("refused", reason="reserve_failed", errors=errors)
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
            local_prefill=request.local_prefill,
            lease_id=lease_id,
            lease_ms=request.lease_ms,
        )
        refuse = lambda error: ReserveReply(ok=False, worker_id=choice.worker_id, error=error)
        try:
            msg = await self.nc.request(
                self.subjects.decode_reserve(choice.worker_id),
                protocol.encode_message(body),
                timeout=self.config.reserve_timeout_s,
            )
        except nats.errors.NoRespondersError:
            return refuse("not listening for reservations")
        except nats.errors.TimeoutError:
            return refuse(f"no reserve reply within {self.config.reserve_timeout_s:g}s")
        if msg.headers and ERROR_HEADER in msg.headers:
            return refuse(msg.headers[ERROR_HEADER])
        try:
            reply = protocol.decode_message(msg.data, ReserveReply)
        except MessageError as exc:
            return refuse(f"malformed reserve reply: {exc}")
        if reply.ok and reply.worker_id != choice.worker_id:
            return refuse(f"reply names worker {reply.worker_id!r}")
        return reply

    # --- admin ----------------------------------------------------------------------------------

    def admin_endpoints(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[Any]]]:
        return {
            self.subjects.ADMIN_STATUS: self.admin_status,
            self.subjects.ADMIN_WORKERS: self.admin_workers,
            self.subjects.ADMIN_DRAIN: lambda body: self.admin_control(body, "drain"),
            self.subjects.ADMIN_RESUME: lambda body: self.admin_control(body, "resume"),
            self.subjects.ADMIN_LOG_LEVEL: self.admin_log_level,
        }

    def json_handler(
        self, handle: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> Callable[[Request], Awaitable[None]]:
        async def handler(req: Request) -> None:
            self._spawn(self._answer_json(req, handle))

        return handler

    async def _answer_json(
        self, req: Request, handle: Callable[[dict[str, Any]], Awaitable[Any]]
    ) -> None:
        try:
            body = orjson.loads(req.data) if req.data.strip() else {}
            if not isinstance(body, dict):
                raise AdminError("the request body must be a JSON object, e.g. '{}'")
            result = await handle(body)
        except orjson.JSONDecodeError as exc:
            result = {"error": f"the request body is not JSON: {exc}"}
        except AdminError as exc:
            result = {"error": str(exc)}
        await req.respond(orjson.dumps(result))

    async def admin_status(self, body: dict[str, Any]) -> dict[str, Any]:
        status = self.core.status(self.clock())
        status["registry"] = {
            "worker_id": self.worker_id,
            "mesh": self.subjects.mesh,
            "uptime_s": round(time.time() - self.started_at, 3),
            "worker_timeout_s": self.config.worker_timeout_s,
        }
        status["prefill_queue"] = await queue_status(self.nc, self.subjects)
        return status

    async def admin_workers(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"workers": self.core.workers(self.clock())}

    async def admin_control(self, body: dict[str, Any], action: str) -> dict[str, Any]:
        worker_id = body.get("worker")
        if not isinstance(worker_id, str) or not worker_id:
            raise AdminError(
                f'{action} needs {{"worker": "<worker id>"}}; see `kvmesh admin workers`'
            )
        subject = self.subjects.worker_control(worker_id)
        try:
            msg = await self.nc.request(
                subject,
                protocol.encode_message(WorkerControl(action=action)),
                timeout=self.config.admin_timeout_s,
            )
        except nats.errors.NoRespondersError:
            raise AdminError(
                f"no worker {worker_id!r} answers on {subject}; `kvmesh admin workers` lists them"
            ) from None
        except nats.errors.TimeoutError:
            raise AdminError(
                f"worker {worker_id!r} did not answer {action} within "
                f"{self.config.admin_timeout_s:g}s"
            ) from None
        if msg.headers and ERROR_HEADER in msg.headers:
            raise AdminError(f"worker {worker_id!r} refused {action}: {msg.headers[ERROR_HEADER]}")
        self.core.mark_draining(worker_id, action == "drain")
        log.info("worker control forwarded", worker_id=worker_id, action=action)
        result: dict[str, Any] = {"ok": True, "worker": worker_id, "action": action}
        with contextlib.suppress(orjson.JSONDecodeError):
            reply = orjson.loads(msg.data) if msg.data else None
            if isinstance(reply, dict) and "state" in reply:
                result["state"] = reply["state"]
        return result

    async def admin_log_level(self, body: dict[str, Any]) -> dict[str, Any]:
        level = body.get("level")
        if not isinstance(level, str) or level.strip().lower() not in logs.LEVELS:
            raise AdminError(
                f'log-level needs {{"level": one of {", ".join(logs.LEVELS)}}}, got {level!r}'
            )
        level = level.strip().lower()
        await self.nc.publish(
            self.subjects.CONTROL_LOG_LEVEL, protocol.encode_message(LogLevel(level=level))
        )
        return {"ok": True, "level": level}

    def _spawn(self, coro: Awaitable[None]) -> None:
        self.tg.create_task(_logged(coro))


async def _logged(coro: Awaitable[None]) -> None:
    """A request task must never take the registry down: log and swallow what escapes it."""
    try:
        await coro
    except nats.errors.Error as exc:
        log.warning("could not answer a request", error=str(exc))
    except Exception:
        log.exception("request handler failed")


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


@contextlib.asynccontextmanager
async def registry_service(config: RegistryConfig) -> AsyncIterator[RegistryService]:
    """Connected, subscribed and answering; stops everything on exit."""
    worker_id = config.worker_id or new_worker_id(ROLE)
    subjects = config.subjects
    async with (
        connect_nats(config.nats_url, worker_id, security=config.nats_security) as nc,
        asyncio.TaskGroup() as tg,
    ):
        service = RegistryService(config, nc, tg, worker_id, subjects)
        expiry = tg.create_task(service.expiry_loop())
        try:
            async with (
                subscriptions(
                    nc,
                    (subjects.REGISTRY_ADVERTISE, DecodeAdvert, service.on_advert),
                    (subjects.HEARTBEAT_ALL, WorkerHeartbeat, service.on_heartbeat),
                    (subjects.decode_prefill_done("*"), PrefillDone, service.on_prefill_done),
                    (subjects.DECODE_LEASE_RENEW_ALL, LeaseRenew, service.on_lease_renew),
                ),
                worker_presence(
                    nc,
                    subjects,
                    role=ROLE,
                    worker_id=worker_id,
                    heartbeat=service.heartbeat,
                    interval_s=config.heartbeat_s,
                ) as svc,
                serve_metrics(
                    service.metrics.registry, config.metrics_host, config.metrics_port
                ) as service.metrics_port,
            ):
                await svc.add_endpoint(
                    name="place", subject=subjects.REGISTRY_PLACE, handler=service.on_place
                )
                for subject, handle in service.admin_endpoints().items():
                    await svc.add_endpoint(
                        name=subject.rsplit(".", 1)[-1],
                        subject=subject,
                        handler=service.json_handler(handle),
                    )
                await nc.flush()
                log.info(
                    "kv-registry ready",
                    worker_id=worker_id,
                    mesh=subjects.mesh,
                    nats_url=config.safe_nats_url,
                    metrics_port=service.metrics_port,
                )
                yield service
        finally:
            expiry.cancel()


async def run_registry(config: RegistryConfig) -> None:
    async with registry_service(config):
        await serve_until_signal()
