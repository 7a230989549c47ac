"""The kv-registry's admin subjects: status, workers, drain/resume, log level (plain JSON).

Each handler takes the request body (a JSON object) and returns the reply body; an
``AdminError`` becomes ``{"error": "..."}``. Drain and resume are forwarded to the worker
(WorkerControl on ``worker_control(worker)``); the log level is broadcast (LogLevel on
CONTROL_LOG_LEVEL).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import orjson
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.core import RegistryState
from kvmesh.services.kv_registry.stores import StoreTable
from kvmesh.shared.bus import protocol
from kvmesh.shared.bus.prefill_queue import queue_status
from kvmesh.shared.bus.protocol import LogLevel, WorkerControl
from kvmesh.shared.bus.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.micro.request import ERROR_HEADER, Request

log = logs.get_logger(__name__)

AdminHandler = Callable[[dict[str, Any]], Awaitable[Any]]


class AdminError(ValueError):
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
        """Reply to one admin request with ``handle``'s result (or ``{"error": ...}``)."""
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
        status["stores"] = self.stores.status(self.clock()) if self.stores is not None else []
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
