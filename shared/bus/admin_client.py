"""Admin requests to a mesh's kv-registry (the messages of shared/bus/messages/admin.py on its
kvmesh.<mesh>.admin.* subjects)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from kvmesh.shared.bus.messages.admin import (
    AdminControlled,
    AdminLogLevelSet,
    AdminStatus,
    AdminWorkers,
    WorkerRow,
)
from kvmesh.shared.bus.messages.codec import M
from kvmesh.shared.bus.nats_auth import NatsAuth
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, connect_nats
from kvmesh.shared.bus.nats_request import request_json
from kvmesh.shared.config.nats_options import NatsSecurity
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from nats.aio.client import Client


class AdminError(RuntimeError):
    """The registry answered with {"error": ...}, or nobody answered."""


class AdminClient:
    def __init__(self, nc: Client, subjects: Subjects, timeout_s: float = 3.0) -> None:
        self.nc = nc
        self.subjects = subjects
        self.timeout_s = timeout_s

    async def status(self) -> AdminStatus:
        return await self._request(self.subjects.ADMIN_STATUS, {}, AdminStatus)

    async def workers(self) -> tuple[WorkerRow, ...]:
        return (await self._request(self.subjects.ADMIN_WORKERS, {}, AdminWorkers)).workers

    async def drain(self, worker_id: str) -> AdminControlled:
        return await self._request(
            self.subjects.ADMIN_DRAIN, {"worker": worker_id}, AdminControlled
        )

    async def resume(self, worker_id: str) -> AdminControlled:
        return await self._request(
            self.subjects.ADMIN_RESUME, {"worker": worker_id}, AdminControlled
        )

    async def log_level(self, level: str) -> AdminLogLevelSet:
        return await self._request(
            self.subjects.ADMIN_LOG_LEVEL, {"level": level}, AdminLogLevelSet
        )

    async def draft_workers(self, listen_s: float = 0.3) -> list[dict[str, Any]]:
        """Every draft worker of the mesh with its acceptance figures: the ``status`` endpoint
        data each one reports to ``$SRV.STATS.kvmesh-draft`` (all answer; replies are gathered
        for ``listen_s``). Sorted by worker id; empty when there is none."""
        import asyncio

        import orjson

        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        rows = []
        try:
            await self.nc.publish("$SRV.STATS.kvmesh-draft", b"", reply=inbox)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + listen_s
            while (left := deadline - loop.time()) > 0:
                try:
                    msg = await sub.next_msg(timeout=left)
                except TimeoutError:
                    break
                if not msg.data:  # the server's "no responders" (status 503): no draft worker
                    break
                try:
                    stats = orjson.loads(msg.data)
                except orjson.JSONDecodeError:
                    continue
                if stats.get("metadata", {}).get("mesh") != self.subjects.mesh:
                    continue  # another mesh's draft worker on the same server
                # every endpoint carries the worker's stats: its ``status`` endpoint's, once
                rows += [
                    e["data"]
                    for e in stats.get("endpoints", [])
                    if e.get("name") == "status" and e.get("data")
                ]
        finally:
            await sub.unsubscribe()
        return sorted(rows, key=lambda r: r.get("worker_id", ""))

    async def _request(self, subject: str, body: dict[str, Any], cls: type[M]) -> M:
        try:
            reply = await request_json(self.nc, subject, body, self.timeout_s)
        except NatsUnavailableError as exc:
            raise AdminError(f"{exc} (mesh {self.subjects.mesh})") from None
        if isinstance(reply, dict) and "error" in reply:
            raise AdminError(str(reply["error"]))
        try:
            return msgspec.convert(reply, cls)
        except msgspec.ValidationError as exc:
            raise AdminError(
                f"the kv-registry answered {subject} with a reply this client does not read "
                f"({exc}): is it another kvmesh version?"
            ) from None


@contextlib.asynccontextmanager
async def admin_client(
    nats_url: str,
    timeout_s: float = 3.0,
    connect_wait_s: float = 3.0,
    auth: NatsAuth | None = None,
    *,
    mesh: str = DEFAULT_MESH,
    security: NatsSecurity | None = None,
) -> AsyncIterator[AdminClient]:
    """An admin client of mesh ``mesh``. ``auth``: default the environment's credentials
    (KVMESH_NATS_USER=admin, ...); ``security``: a credentials file and TLS."""
    subjects = Subjects(mesh)
    async with connect_nats(
        nats_url, "kvmesh-admin", connect_wait_s=connect_wait_s, auth=auth, security=security
    ) as nc:
        yield AdminClient(nc, subjects, timeout_s)
