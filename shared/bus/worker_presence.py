"""What makes a worker visible and controllable on NATS: its id, its micro service, its
heartbeats (from a liveness beacon: shared/bus/liveness.py), periodic publishing, the mesh-wide
log level, and its answer to a drain or resume (``WorkerControl``). ``worker_shell.serve_worker``
puts them together in every service's start-up."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
from kvmesh.shared.bus.liveness import liveness_beacon
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.workers import LogLevel, WorkerControl, WorkerHeartbeat
from kvmesh.shared.bus.nats_connect import VettedClient
from kvmesh.shared.bus.nats_request import micro_service
from kvmesh.shared.bus.nats_subscribe import subscriptions
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.micro.request import Request
from nats.micro.service import Service

log = logs.get_logger(__name__)


def new_worker_id(role: str) -> str:
    """A short unique id, safe as a NATS subject token and a micro-service metadata value."""
    return f"{role}-{uuid.uuid4().hex[:8]}"


async def publish_every(
    nc: Client, subject: str, make_message: Callable[[], Any], interval_s: float
) -> None:
    """Publish ``encode(make_message())`` on ``subject`` now and every ``interval_s`` (a task body).

    A failing publish (NATS reconnecting) is logged and retried at the next tick, never fatal."""
    assert interval_s > 0, interval_s
    while True:
        try:
            await nc.publish(subject, encode_message(make_message()))
        except nats.errors.Error as exc:
            log.debug("periodic publish failed", subject=subject, error=str(exc))
        await asyncio.sleep(interval_s)


async def heartbeat_loop(
    nc: Client,
    subjects: Subjects,
    role: str,
    worker_id: str,
    make_heartbeat: Callable[[], WorkerHeartbeat],
    interval_s: float,
) -> None:
    """Publish WorkerHeartbeat on ``subjects.heartbeat(role, worker_id)`` forever (a task body)."""
    await publish_every(nc, subjects.heartbeat(role, worker_id), make_heartbeat, interval_s)


@contextlib.asynccontextmanager
async def log_level_control(
    nc: Client, subjects: Subjects, service: str = ""
) -> AsyncIterator[None]:
    """Follow ``subjects.CONTROL_LOG_LEVEL``: each LogLevel message sets this process's level.
    The mesh-wide change is logged once, by the kv-registry that sent it (``kvmesh admin
    log-level``); each service notes its own change at debug, naming itself (``service``), and
    only when its level did change."""

    async def set_level(message: LogLevel) -> None:
        before = logs.current_level()
        try:
            logs.set_level(message.level)
        except ValueError as exc:
            log.warning("ignored log-level message", error=str(exc), service=service)
            return
        now = logs.current_level()
        if now != before:
            log.debug(f"log level changed from {before} to {now}", level=now, service=service)

    async with subscriptions(nc, (subjects.CONTROL_LOG_LEVEL, LogLevel, set_level)):
        yield


@contextlib.asynccontextmanager
async def worker_presence(
    nc: Client,
    subjects: Subjects,
    *,
    role: str,
    worker_id: str,
    heartbeat: Callable[[], WorkerHeartbeat],
    interval_s: float,
    stall_limit_s: float,
    metadata: dict[str, str] | None = None,
    stats: Callable[[], Any] | None = None,
) -> AsyncIterator[Service]:
    """Everything that makes a worker visible and controllable: micro-service registration,
    its heartbeats and the log-level subscription. Yields the micro Service.

    The heartbeats come from a liveness beacon (shared/bus/liveness.py): a thread with its own
    connection (``nc``'s sibling), beating while this loop is busy, for up to ``stall_limit_s``
    without a tick of it."""
    if not isinstance(nc, VettedClient):
        raise TypeError("worker_presence needs a connection made by connect_nats (its sibling)")
    async with (
        liveness_beacon(
            lambda: nc.sibling("liveness"),
            subjects.heartbeat(role, worker_id),
            heartbeat,
            interval_s=interval_s,
            stall_limit_s=stall_limit_s,
        ) as beacon,
        micro_service(
            nc,
            role=role,
            worker_id=worker_id,
            metadata={"mesh": subjects.mesh, **(metadata or {})},
            stats=stats,
        ) as svc,
        log_level_control(nc, subjects, worker_id),
    ):
        nc.beacon = beacon
        try:
            yield svc
        finally:
            nc.beacon = None


async def read_worker_control(req: Request) -> str | None:
    """The action of a ``WorkerControl`` request, "drain" or "resume"; a malformed one is
    answered with a 400 here and gives None."""
    try:
        action = decode_message(req.data, WorkerControl).action
        if action not in ("drain", "resume"):
            raise MessageError(f"WorkerControl.action: {action!r} is not drain or resume")
    except MessageError as exc:
        await req.respond_error("400", str(exc))
        return None
    return action


async def answer_worker_control(
    nc: Client, subjects: Subjects, req: Request, heartbeat: WorkerHeartbeat
) -> None:
    """Announce a worker's new state at once, then answer the ``WorkerControl`` request with it.

    The heartbeat is published first: the router and registry see a drain or resume now, not at
    the next tick of the heartbeat loop (a router that heard one prefill worker's drain but not
    yet the other's resume would count none ready and prefill on the decode worker). Whoever
    hears both on one connection hears the heartbeat before the answer. With a liveness beacon
    (worker_presence) the heartbeat goes on the beacon's connection, where every other heartbeat
    of the worker goes, and is processed by the server before the answer is sent."""
    data = encode_message(heartbeat)
    beacon = nc.beacon if isinstance(nc, VettedClient) else None
    if beacon is None or not await beacon.announce(heartbeat):
        try:
            await nc.publish(subjects.heartbeat(heartbeat.role, heartbeat.worker_id), data)
        except nats.errors.Error as exc:  # reconnecting: the beacon says it next tick
            log.debug("control heartbeat not sent", error=str(exc))
    await req.respond(data)
