"""Plumbing every kvmesh service shares: NATS connection, discoverability, heartbeats, log level,
signals. Each piece is an async context manager or a coroutine meant for a TaskGroup. The
heartbeats go out from a thread and connection of their own (shared/bus/liveness.py).

A worker's ``run(config)`` typically reads::

    subjects = config.subjects                           # the mesh's (shared/config/subjects.py)
    async with connect_nats(config.nats_url, f"decode-{worker_id}",
                            security=config.nats_security) as nc:
        async with worker_presence(nc, subjects, role="decode", worker_id=worker_id,
                                   heartbeat=make_heartbeat, interval_s=config.heartbeat_s,
                                   stall_limit_s=config.stall_limit_s) as svc:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(...)                # the service's own loops
                async with open_for_requests(nc, svc, *endpoints, metrics=..., ...):
                    await serve_until_signal()     # SIGTERM / SIGINT
                ...                                # drain, then cancel the loops
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import nats
import nats.micro
import orjson
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.liveness import LivenessBeacon, liveness_beacon
from kvmesh.shared.bus.message_guard import guard_of
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.workers import LogLevel, WorkerControl, WorkerHeartbeat
from kvmesh.shared.bus.nats_auth import ADMIN, PASSWORD_FILE_ENV, USER_ENV, NatsAuth, auth_from_env
from kvmesh.shared.bus.nats_vetting import NatsVettingError, holder_note, vet_connection
from kvmesh.shared.config.nats_options import (
    NatsSecurity,
    redact_secrets,
    redact_url,
    split_nats_urls,
    url_has_credentials,
)
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from kvmesh.shared.obs.metrics_exporter import serve_metrics
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.request import Request
from nats.micro.service import Service

if TYPE_CHECKING:
    from kvmesh.shared.config.worker_config import MetricsServiceConfig
    from kvmesh.shared.obs.metric_set import MetricSet

log = logs.get_logger(__name__)

SERVICE_VERSION = "0.1.0"

M = TypeVar("M")
Handler = Callable[[Any], Awaitable[None]]
RequestHandler = Callable[[Request], Awaitable[None]]


class NatsUnavailableError(ConnectionError):
    """No NATS server answered at the configured URL."""


def new_worker_id(role: str) -> str:
    """A short unique id, safe as a NATS subject token and a micro-service metadata value."""
    return f"{role}-{uuid.uuid4().hex[:8]}"


class UnverifiedServerError(nats.errors.Error):
    """A reconnect reached a server that must not get this client's credentials; nats-py
    counts it as a failed attempt and tries again (the mesh's own server may come back)."""


def _address(sockaddr: object) -> tuple[str, int] | None:
    """(host, port) of an AF_INET or AF_INET6 socket address; None for anything else."""
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return str(sockaddr[0]), int(sockaddr[1])
    return None


class VettedClient(Client):
    """nats-py's client, asking ``refusal`` before each CONNECT (which carries the credentials)
    whether this connection's server may have them: the first connect fails with
    NatsVettingError, a reconnect attempt with UnverifiedServerError (and is retried)."""

    def __init__(
        self,
        refusal: Callable[[VettedClient], str | None],
        on_refused: Callable[[str], None],
    ) -> None:
        super().__init__()
        self._refusal = refusal
        self._on_refused = on_refused
        self._connected_once = False  # a refusal after it is a reconnect attempt's
        # a second connection like this one (same server, credentials and vetting), named
        # ``<name>-<suffix>``: set by connect_nats; the liveness beacon's (shared/bus/liveness.py)
        self.sibling: Callable[[str], contextlib.AbstractAsyncContextManager[Client]] | None = None
        self.beacon: LivenessBeacon | None = None  # set while worker_presence runs

    async def connect(self, *args: Any, **kwargs: Any) -> None:
        await super().connect(*args, **kwargs)
        self._connected_once = True

    def connection_facts(self) -> tuple[tuple[str, int] | None, tuple[str, int] | None, bool]:
        """(our address, the server's address, whether TLS verified the server) of the socket
        this client is connecting over; addresses None when it is not a TCP socket."""
        transport = self._transport
        bare = getattr(transport, "_bare_io_writer", None)
        wrapped = getattr(transport, "_io_writer", None)
        ours = bare.get_extra_info("sockname") if bare is not None else None
        theirs = bare.get_extra_info("peername") if bare is not None else None
        ssl_object = wrapped.get_extra_info("ssl_object") if wrapped is not None else None
        tls_verified = ssl_object is not None and self.ssl_context.verify_mode == ssl.CERT_REQUIRED
        return _address(ours), _address(theirs), tls_verified

    def _connect_command(self) -> bytes:
        why = self._refusal(self)
        if why is not None:
            self._on_refused(why)
            if self._connected_once:
                raise UnverifiedServerError(why)
            raise NatsVettingError(why)
        return super()._connect_command()


@contextlib.asynccontextmanager
async def connect_nats(
    url: str,
    name: str,
    *,
    connect_wait_s: float = 10.0,
    reconnect_time_wait_s: float = 0.5,
    auth: NatsAuth | None = None,
    security: NatsSecurity | None = None,
    hearing: Hearing | None = None,
) -> AsyncIterator[Client]:
    """Connect (retrying for ``connect_wait_s``), reconnect forever after, drain on exit.
    ``hearing``: told of every disconnect and reconnect (shared/bus/hearing.py), so that the
    service's liveness checks do not count an outage as its peers' silence.
    ``auth``: user and password; default those in the environment (shared/bus/nats_auth.py), none
    on an open server. ``security``: a credentials file and TLS (shared/config/nats_options.py); a
    token or user:password in ``url`` works too. Logs and errors show ``url`` redacted."""
    shown = redact_url(url)
    try:
        auth = auth if auth is not None else auth_from_env()
        extra = security.connect_options() if security is not None else {}
    except ValueError as exc:  # NatsOptionsError, or unreadable credentials in the environment
        raise NatsUnavailableError(str(exc)) from None
    refused: list[str] = []  # the server turned our credentials down
    tls_failures: list[str] = []

    async def on_error(exc: Exception) -> None:
        if isinstance(exc, ssl.SSLError):
            tls_failures.append(str(exc))
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
        if hearing is not None:
            hearing.on_disconnected(time.monotonic())
        log.warning("nats disconnected, reconnecting", name=name, url=shown)

    # Credentials were made for one server, and a server's INFO is its own word: before every
    # CONNECT (reconnects too) the connection is checked (shared/bus/nats_vetting.py), and a
    # server that fails gets nothing. One that asks for no credentials is not theirs either.
    given_credentials = bool(
        auth or url_has_credentials(url) or (security is not None and security.creds)
    )
    trust_network = security is not None and security.trust_network
    vetting_refusals: list[str] = []

    def refusal(client: VettedClient) -> str | None:
        """Why credentials must not go to the server ``client`` is connected to, or None."""
        if not given_credentials:
            return None
        ours, theirs, tls_verified = client.connection_facts()
        if not client._server_info.get("auth_required"):
            host, port = theirs or ("", 0)
            return (
                f"the NATS server at {host}:{port}{holder_note(host, port)} asks for no "
                f"credentials, but {name} was given some: it is not the server they were made "
                "for (another user's, started first on that port?), and nothing is sent to it; "
                "stop it, or connect without credentials to use an open server"
            )
        return vet_connection(ours, theirs, tls_verified=tls_verified, trust_network=trust_network)

    def on_refused(why: str) -> None:
        if not vetting_refusals:  # then counted, not logged again each reconnect attempt
            log.error("refusing the NATS server", name=name, why=why)
        vetting_refusals.append(why)

    async def on_reconnected() -> None:
        if hearing is not None:
            hearing.on_reconnected(time.monotonic())
        log.info("nats reconnected", name=name, url=shown)

    nc = VettedClient(refusal, on_refused)
    try:
        await asyncio.wait_for(
            nc.connect(
                # a cluster's members, in the order given: the host's own server first, the
                # others to reconnect to when it goes
                servers=split_nats_urls(url),
                dont_randomize=True,
                # a silently cut link (no FIN, no RST) is noticed in ~10 s, not nats-py's 4 min
                ping_interval=5,
                max_outstanding_pings=2,
                name=name,
                connect_timeout=2,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_time_wait_s,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                **(auth.connect_options() if auth else {}),
                **extra,
            ),
            timeout=connect_wait_s,
        )
    except NatsVettingError as exc:
        closing = True
        await nc.close()
        raise NatsUnavailableError(str(exc)) from None
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        closing = True
        await nc.close()
        if refused:
            if auth:
                who = f"user {auth.user!r}"
            elif url_has_credentials(url):
                who = "the credentials in the URL"
            elif security is not None and security.creds:
                who = f"--nats-creds {security.creds}"
            else:
                who = "no credentials"
            raise NatsUnavailableError(
                f"the NATS server at {shown} refused {who} (authorization violation); a mesh "
                f"started by `kvmesh up` has one user per role: set {USER_ENV}={ADMIN} and "
                f"{PASSWORD_FILE_ENV} to the file `kvmesh up` printed"
            ) from None
        if tls_failures or isinstance(exc, ssl.SSLError):
            detail = tls_failures[-1] if tls_failures else str(exc)
            raise NatsUnavailableError(
                f"TLS with the NATS server at {shown} failed ({detail}); check --nats-tls-ca "
                "(the CA that signed the server's certificate), --nats-tls-cert/--nats-tls-key, "
                "and that the URL's host is a name in the certificate"
            ) from None
        raise NatsUnavailableError(
            f"no NATS server answered at {shown} within {connect_wait_s:g}s "
            f"({type(exc).__name__}: {redact_secrets(str(exc), url)}); start one (`kvmesh up` "
            "does, or `nats-server -js`) or pass --nats-url / KVMESH_NATS_URL"
        ) from None

    def sibling(suffix: str) -> contextlib.AbstractAsyncContextManager[Client]:
        return connect_nats(
            url,
            f"{name}-{suffix}",
            connect_wait_s=connect_wait_s,
            reconnect_time_wait_s=reconnect_time_wait_s,
            auth=auth,
            security=security,
        )

    nc.sibling = sibling
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
    stats: Callable[[], Any] | None = None,
) -> AsyncIterator[Service]:
    """Register this worker as NATS micro service ``kvmesh-<role>``: answers $SRV.PING/INFO/STATS
    (``nats micro ls``); metadata carries worker_id and role. Add request/reply endpoints with
    ``await svc.add_endpoint(name=..., subject=..., handler=..., queue_group=...)``.
    ``stats``: what $SRV.STATS reports as each endpoint's ``data`` (JSON-serializable)."""
    meta = {"worker_id": worker_id, "role": role, **(metadata or {})}
    svc = await nats.micro.add_service(
        nc,
        name=f"kvmesh-{role}",
        version=SERVICE_VERSION,
        description=description or f"kvmesh {role} worker {worker_id}",
        metadata=meta,
        **({"stats_handler": lambda _endpoint: stats()} if stats is not None else {}),
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


def on_message(
    nc: Client, cls: type[M], handle: Callable[[M], Awaitable[None]]
) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback: decodes each message as ``cls`` and awaits ``handle(message)``,
    through ``nc``'s MessageGuard (shared/bus/message_guard.py): a malformed or oversized message
    (another version's, a stray publisher's) is refused, and what ``handle`` raises is logged
    and counted. A message is data, never a reason for a service to fail."""
    return guard_of(nc).typed(cls, handle)


async def guarded_subscribe(
    nc: Client,
    subject: str,
    handle: Callable[[Msg], Awaitable[None]],
    *,
    queue: str = "",
    needs_reply: bool = False,
) -> Subscription:
    """``nc.subscribe`` for a handler that reads raw messages, through ``nc``'s MessageGuard:
    oversized ones are refused (and, ``needs_reply``, those without a reply subject) and what
    ``handle`` raises is contained."""
    return await nc.subscribe(
        subject, queue=queue, cb=guard_of(nc).raw(handle, needs_reply=needs_reply)
    )


@contextlib.asynccontextmanager
async def subscriptions(nc: Client, *routes: tuple[str, type[Any], Handler]) -> AsyncIterator[None]:
    """Subscribe ``(subject, message type, handler)`` routes for the duration of the block: each
    message is decoded as its route's type and handed to its handler (``on_message``)."""
    subs = []
    try:
        for subject, cls, handle in routes:
            subs.append(await nc.subscribe(subject, cb=on_message(nc, cls, handle)))
        yield
    finally:
        if not nc.is_closed:
            for sub in subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()


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
    connection (``nc``'s sibling, made by connect_nats), beating while this loop is busy, for up
    to ``stall_limit_s`` without a tick of it."""
    if not isinstance(nc, VettedClient) or nc.sibling is None:
        raise TypeError("worker_presence needs a connection made by connect_nats (its sibling)")
    open_sibling = nc.sibling
    async with (
        liveness_beacon(
            lambda: open_sibling("liveness"),
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


async def flush_to_server(nc: Client) -> None:
    """Return once the server has processed everything ``nc`` sent so far (subscriptions made,
    messages published). nats-py's ``flush()`` writes its PING straight to the socket, ahead of
    the commands still queued for its flusher task (a SUB or PUB just made), so its PONG alone
    does not prove they arrived: the server may see the SUB after the PING. The first round
    trip lets the flusher write the queue (it runs while this task waits for the PONG); the
    second PING follows it on the socket, so its PONG comes after they were processed."""
    await nc.flush()
    await nc.flush()


@contextlib.asynccontextmanager
async def open_for_requests(
    nc: Client,
    svc: Service,
    *endpoints: tuple[str, str, RequestHandler],
    metrics: MetricSet,
    config: MetricsServiceConfig,
    worker_id: str,
    logger: Any,
    ready: str,
    **log_fields: Any,
) -> AsyncIterator[int | None]:
    """A worker's last start-up step, once its subscriptions and loops run: serve ``metrics`` on
    ``config``'s metrics host and port (``serve_metrics``; the connection's refused messages
    counted in its ``nats_refused``), add the ``(name, subject, handler)`` request/reply
    endpoints to ``svc``, each behind the connection's MessageGuard, flush (the server holds every subscription), then log
    ``ready`` on the service's ``logger`` with the worker id, the mesh, ``log_fields`` and the
    bound metrics port. Yields that port (None: no metrics endpoint)."""
    guard = guard_of(nc)
    guard.count_into(metrics.nats_refused)
    async with serve_metrics(
        metrics.registry, config.metrics_host, config.metrics_port
    ) as bound_port:
        for name, subject, handler in endpoints:
            await svc.add_endpoint(name=name, subject=subject, handler=guard.request(handler))
        await flush_to_server(nc)
        logger.info(
            ready,
            worker_id=worker_id,
            mesh=config.subjects.mesh,
            **log_fields,
            metrics_port=bound_port,
        )
        yield bound_port


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
