"""The kv-registry's admin subjects: status, workers, drain/resume, log level.

Each handler takes the request body (JSON bytes) and returns the reply, one of the admin messages
of shared/bus/messages/admin.py; an ``AdminRequestError`` becomes ``AdminFailure``
(``{"error": "..."}``). Drain and resume are forwarded to the worker (WorkerControl on
``worker_control(worker)``); the log level is broadcast (LogLevel on CONTROL_LOG_LEVEL).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats.errors
import orjson
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.shared.bus.messages.admin import (
    AdminControlled,
    AdminFailure,
    AdminLogLevel,
    AdminLogLevelSet,
    AdminStatus,
    AdminWorker,
    AdminWorkers,
    RegistryInfo,
)
from kvmesh.shared.bus.messages.codec import Message, MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.workers import LogLevel, WorkerControl, WorkerHeartbeat
from kvmesh.shared.bus.prefill_job_stream import queue_status
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.micro.request import ERROR_HEADER, Request

log = logs.get_logger(__name__)

AdminHandler = Callable[[bytes], Awaitable[Message]]


class AdminRequestError(ValueError):
    """An admin request the registry cannot carry out; the message goes back as {"error": ...}."""


@dataclass(eq=False)
class RegistryAdmin:
    """Answers the admin subjects of one registry (``started_at``: wall clock)."""

    config: RegistryConfig
    nc: Client
    subjects: Subjects
    core: RegistryState
    worker_id: str
    started_at: float
    clock: Callable[[], float] = time.monotonic
    stores: StoreTable | None = None  # the KV stores' adverts (docs/kv_store.md)
    # optional services dropped for silence and not heard since: worker id -> role
    silent_optional: dict[str, str] = field(default_factory=dict)

    def handlers(self) -> dict[str, AdminHandler]:
        """The handler of each admin subject."""
        return {
            self.subjects.ADMIN_STATUS: self.admin_status,
            self.subjects.ADMIN_WORKERS: self.admin_workers,
            self.subjects.ADMIN_DRAIN: lambda body: self.admin_control(body, "drain"),
            self.subjects.ADMIN_RESUME: lambda body: self.admin_control(body, "resume"),
            self.subjects.ADMIN_LOG_LEVEL: self.admin_log_level,
        }

    async def answer(self, req: Request, handle: AdminHandler) -> None:
        """Reply to one admin request with ``handle``'s result (or ``AdminFailure``)."""
        try:
            result = await handle(req.data)
        except AdminRequestError as exc:
            result = AdminFailure(str(exc))
        await req.respond(encode_message(result))

    async def admin_status(self, body: bytes) -> AdminStatus:
        _request_object(body)
        now = self.clock()
        rows = self.core.status(now)
        return AdminStatus(
            decode=rows.decode,
            workers=rows.workers,
            leases=rows.leases,
            stores=self.stores.status(now) if self.stores is not None else (),
            registry=RegistryInfo(
                worker_id=self.worker_id,
                mesh=self.subjects.mesh,
                uptime_s=round(time.time() - self.started_at, 3),
                worker_timeout_s=self.config.worker_timeout_s,
            ),
            prefill_queue=await queue_status(self.nc, self.subjects),
            degraded=tuple(
                f"{role} ({worker_id} silent)"
                for worker_id, role in sorted(self.silent_optional.items())
            ),
        )

    async def admin_workers(self, body: bytes) -> AdminWorkers:
        _request_object(body)
        return AdminWorkers(self.core.workers(self.clock()))

    async def admin_control(self, body: bytes, action: str) -> AdminControlled:
        _request_object(body)
        try:
            worker_id = decode_message(body or b"{}", AdminWorker).worker
        except MessageError:
            worker_id = ""
        if not worker_id:
            raise AdminRequestError(
                f'{action} needs {{"worker": "<worker id>"}}; see `kvmesh admin workers`'
            )
        subject = self.subjects.worker_control(worker_id)
        try:
            msg = await self.nc.request(
                subject,
                encode_message(WorkerControl(action=action)),
                timeout=self.config.admin_timeout_s,
            )
        except nats.errors.NoRespondersError:
            raise AdminRequestError(
                f"no worker {worker_id!r} answers on {subject}; `kvmesh admin workers` lists them"
            ) from None
        except nats.errors.TimeoutError:
            raise AdminRequestError(
                f"worker {worker_id!r} did not answer {action} within "
                f"{self.config.admin_timeout_s:g}s"
            ) from None
        if msg.headers and ERROR_HEADER in msg.headers:
            raise AdminRequestError(
                f"worker {worker_id!r} refused {action}: {msg.headers[ERROR_HEADER]}"
            )
        self.core.mark_draining(worker_id, action == "drain")
        log.info("worker control forwarded", worker_id=worker_id, action=action)
        state = ""  # the worker answers with its heartbeat (answer_worker_control)
        with contextlib.suppress(MessageError):
            state = decode_message(msg.data, WorkerHeartbeat).load.state
        return AdminControlled(ok=True, worker=worker_id, action=action, state=state)

    async def admin_log_level(self, body: bytes) -> AdminLogLevelSet:
        _request_object(body)
        needs = f'log-level needs {{"level": one of {", ".join(logs.LEVELS)}}}'
        try:
            level = decode_message(body or b"{}", AdminLogLevel).level
        except MessageError as exc:
            raise AdminRequestError(f"{needs} ({exc})") from None
        if level.strip().lower() not in logs.LEVELS:
            raise AdminRequestError(f"{needs}, got {level!r}")
        level = level.strip().lower()
        await self.nc.publish(
            self.subjects.CONTROL_LOG_LEVEL, encode_message(LogLevel(level=level))
        )
        # the one line for the whole mesh (each service notes its own change at debug)
        log.warning(
            f"log level set to {level} on every service (kvmesh admin log-level)",
            level=level,
            service=self.worker_id,
        )
        return AdminLogLevelSet(ok=True, level=level)


def _request_object(body: bytes) -> None:
    """An admin request body must be a JSON object (``{}`` when it says nothing) or empty."""
    if not body.strip():
        return
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise AdminRequestError(f"the request body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise AdminRequestError("the request body must be a JSON object, e.g. '{}'")
