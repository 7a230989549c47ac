"""Plumbing every kvmesh service shares: NATS connection, discoverability, heartbeats, log level,
signals. Each piece is an async context manager or a coroutine meant for a TaskGroup.

A worker's ``run(config)`` typically reads::

    async with connect_nats(config.nats_url, f"decode-{worker_id}") as nc:
        async with worker_presence(nc, role="decode", worker_id=worker_id,
                                   heartbeat=make_heartbeat, interval_s=config.heartbeat_s):
            async with asyncio.TaskGroup() as tg:
                tg.create_task(...)                # the service's own loops
                await serve_until_signal()         # SIGTERM / SIGINT
                ...                                # drain, then cancel the loops
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import nats
import nats.micro
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from nats.micro.service import Service

from shared import logs, protocol, subjects
from shared.nats_auth import ADMIN, PASSWORD_FILE_ENV, USER_ENV, NatsAuth, auth_from_env

log = logs.get_logger(__name__)

SERVICE_VERSION = "0.1.0"


class NatsUnavailableError(ConnectionError):
    """No NATS server answered at the configured URL."""


def new_worker_id(role: str) -> str:
    """A short unique id, safe as a NATS subject token and a micro-service metadata value."""
    return f"{role}-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def connect_nats(
    url: str,
    name: str,
    *,
    connect_wait_s: float = 10.0,
    reconnect_time_wait_s: float = 0.5,
    auth: NatsAuth | None = None,
) -> AsyncIterator[Client]:
    """Connect (retrying for ``connect_wait_s``), reconnect forever after, drain on exit.
    ``auth``: the credentials; default those in the environment (shared/nats_auth.py), none
    on an open server."""
    auth = auth if auth is not None else auth_from_env()
    refused: list[str] = []  # the server turned our credentials down

    async def on_error(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower():
            refused.append(str(exc))
        if "permissions violation" in str(exc).lower():  # a role sent what it may not
            log.warning("nats refused an operation", name=name, error=str(exc))
        else:
            log.debug("nats error", name=name, error=str(exc))

    closing = False

    async def on_disconnected() -> None:
        if closing or nc.is_closed:
            return
        log.warning("nats disconnected, reconnecting", name=name, url=url)

    async def on_reconnected() -> None:
        log.info(
            "nats reconnected", name=name, url=nc.connected_url.netloc if nc.connected_url else url
        )

    nc = Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=[url],
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_time_wait_s,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **(auth.connect_options() if auth else {}),
            ),
            timeout=connect_wait_s,
        )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        closing = True
        await nc.close()
        if refused:
            who = f"user {auth.user!r}" if auth else "no credentials"
            raise NatsUnavailableError(
                f"the NATS server at {url} refused {who} (authorization violation); a mesh "
                f"started by `kvmesh up` has one user per role: set {USER_ENV}={ADMIN} and "
                f"{PASSWORD_FILE_ENV} to the file `kvmesh up` printed"
            ) from None
        raise NatsUnavailableError(
            f"no NATS server answered at {url} within {connect_wait_s:g}s ({exc!r}); start one "
            "(`kvmesh up` does, or `nats-server -js`) or pass --nats-url / KVMESH_NATS_URL"
        ) from None
    try:
        yield nc
    finally:
        closing = True
        if not nc.is_closed:
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await asyncio.wait_for(nc.drain(), timeout=5.0)
            if not nc.is_closed:
                await nc.close()


@contextlib.asynccontextmanager
async def micro_service(
    nc: Client,
    *,
    role: str,
    worker_id: str,
    description: str = "",
    metadata: dict[str, str] | None = None,
) -> AsyncIterator[Service]:
    """Register this worker as NATS micro service ``kvmesh-<role>``: answers $SRV.PING/INFO/STATS
    (``nats micro ls``); metadata carries worker_id and role. Add request/reply endpoints with
    ``await svc.add_endpoint(name=..., subject=..., handler=..., queue_group=...)``."""
    meta = {"worker_id": worker_id, "role": role, **(metadata or {})}
    svc = await nats.micro.add_service(
        nc,
        name=f"kvmesh-{role}",
        version=SERVICE_VERSION,
        description=description or f"kvmesh {role} worker {worker_id}",
        metadata=meta,
    )
    try:
        yield svc
    finally:
        if not nc.is_closed:
            await svc.stop()


async def publish_every(
    nc: Client, subject: str, make_message: Callable[[], Any], interval_s: float
) -> None:
    """Publish ``encode(make_message())`` on ``subject`` now and every ``interval_s`` (a task body).

    A failing publish (NATS reconnecting) is logged and retried at the next tick, never fatal."""
    assert interval_s > 0, interval_s
    while True:
        try:
            await nc.publish(subject, protocol.encode(make_message()))
        except nats.errors.Error as exc:
            log.debug("periodic publish failed", subject=subject, error=str(exc))
        await asyncio.sleep(interval_s)


async def heartbeat_loop(
    nc: Client,
    role: str,
    worker_id: str,
    make_heartbeat: Callable[[], protocol.WorkerHeartbeat],
    interval_s: float,
) -> None:
    """Publish WorkerHeartbeat on ``subjects.heartbeat(role, worker_id)`` forever (a task body)."""
    await publish_every(nc, subjects.heartbeat(role, worker_id), make_heartbeat, interval_s)


@contextlib.asynccontextmanager
async def log_level_control(nc: Client) -> AsyncIterator[None]:
    """Follow ``subjects.CONTROL_LOG_LEVEL``: each LogLevel message sets this process's level."""

    async def on_message(msg: Msg) -> None:
        try:
            level = protocol.decode(msg.data, protocol.LogLevel).level
            logs.set_level(level)
        except ValueError as exc:  # ProtocolError is a ValueError too
            log.warning("ignored log-level message", error=str(exc))
            return
        log.warning(f"log level changed to {level}", level=level)

    sub = await nc.subscribe(subjects.CONTROL_LOG_LEVEL, cb=on_message)
    try:
        yield
    finally:
        if not nc.is_closed:
            await sub.unsubscribe()


async def read_worker_control(req: Request) -> str | None:
    """The action of a ``WorkerControl`` request, "drain" or "resume"; a malformed one is
    answered with a 400 here and gives None."""
    try:
        action = protocol.decode(req.data, protocol.WorkerControl).action
        if action not in ("drain", "resume"):
            raise protocol.ProtocolError(f"WorkerControl.action: {action!r} is not drain or resume")
    except protocol.ProtocolError as exc:
        await req.respond_error("400", str(exc))
        return None
    return action


@contextlib.asynccontextmanager
async def worker_presence(
    nc: Client,
    *,
    role: str,
    worker_id: str,
    heartbeat: Callable[[], protocol.WorkerHeartbeat],
    interval_s: float,
    metadata: dict[str, str] | None = None,
) -> AsyncIterator[Service]:
    """Everything that makes a worker visible and controllable: micro-service registration,
    a heartbeat task and the log-level subscription. Yields the micro Service."""
    async with (
        micro_service(nc, role=role, worker_id=worker_id, metadata=metadata) as svc,
        log_level_control(nc),
        background(heartbeat_loop(nc, role, worker_id, heartbeat, interval_s)),
    ):
        yield svc


@contextlib.asynccontextmanager
async def background(*coros: Coroutine[Any, Any, Any]) -> AsyncIterator[None]:
    """Run coroutines as tasks of a TaskGroup for the duration of the block; cancel them on exit.

    A task that fails cancels the block (TaskGroup semantics) and its error propagates."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(c) for c in coros]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()


async def serve_until_signal(
    stop: asyncio.Event | None = None,
    signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
) -> signal.Signals | None:
    """Wait for SIGTERM/SIGINT (returns it) or for ``stop`` to be set (returns None)."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[signal.Signals] = loop.create_future()

    def on_signal(sig: signal.Signals) -> None:
        if not got.done():
            got.set_result(sig)

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    waiters: list[asyncio.Future[Any]] = [got]
    stop_task = asyncio.ensure_future(stop.wait()) if stop is not None else None
    if stop_task is not None:
        waiters.append(stop_task)
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if stop_task is not None:
            stop_task.cancel()
    if got.done():
        log.info("signal received, stopping", signal=got.result().name)
        return got.result()
    return None


async def request_json(nc: Client, subject: str, body: dict[str, Any], timeout_s: float) -> Any:
    """Plain-JSON request/reply (admin subjects). Raises NatsUnavailableError on no responders."""
    try:
        msg = await nc.request(subject, orjson.dumps(body), timeout=timeout_s)
    except nats.errors.NoRespondersError:
        raise NatsUnavailableError(
            f"nobody answers {subject}: is the kv-registry running (`kvmesh serve kv-registry`)?"
        ) from None
    except nats.errors.TimeoutError:
        raise NatsUnavailableError(f"no reply on {subject} within {timeout_s:g}s") from None
    return orjson.loads(msg.data)
