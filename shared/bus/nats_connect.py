"""A service's NATS connection: ``connect_nats`` connects (retrying for a while), reconnects
forever after, vets every server before it gets credentials, and drains on exit; its errors say
what to fix. ``flush_to_server`` waits until the server has processed what was sent.

A connection is a ``VettedClient``: nats-py's client, whose event callbacks (errors, disconnects,
reconnects) are its own methods, and which asks its ``NatsTarget`` before each CONNECT (the
message that carries the credentials) whether this server may have them
(shared/bus/nats_vetting.py). Credentials were made for one server, and a server's INFO is its
own word: a server that fails gets nothing, reconnects included; one that asks for no
credentials is not theirs either.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import nats
from kvmesh.shared.bus.hearing import Hearing
from kvmesh.shared.bus.liveness import LivenessBeacon
from kvmesh.shared.bus.nats_auth import ADMIN, PASSWORD_FILE_ENV, USER_ENV, NatsAuth, auth_from_env
from kvmesh.shared.bus.nats_vetting import NatsVettingError, holder_note, vet_connection
from kvmesh.shared.config.nats_options import (
    NatsSecurity,
    redact_secrets,
    redact_url,
    split_nats_urls,
    url_has_credentials,
)
from kvmesh.shared.obs import logs
from nats.aio.client import Client

log = logs.get_logger(__name__)

Address = tuple[str, int]


class NatsUnavailableError(ConnectionError):
    """No NATS server answered at the configured URL (or none that may have the credentials)."""


class UnverifiedServerError(nats.errors.Error):
    """A reconnect reached a server that must not get this client's credentials; nats-py
    counts it as a failed attempt and tries again (the mesh's own server may come back)."""


@dataclass(frozen=True, slots=True)
class NatsTarget:
    """Where and as whom a client connects: the URL (a cluster's members, comma-separated), the
    client's name, its credentials and TLS options, and how long it waits."""

    url: str
    name: str
    auth: NatsAuth | None  # user and password (shared/bus/nats_auth.py)
    security: NatsSecurity | None  # a credentials file and TLS (shared/config/nats_options.py)
    options: Mapping[str, Any]  # security's connect options, read once (a creds file)
    connect_wait_s: float
    reconnect_time_wait_s: float

    @classmethod
    def resolve(
        cls,
        url: str,
        name: str,
        auth: NatsAuth | None,
        security: NatsSecurity | None,
        connect_wait_s: float,
        reconnect_time_wait_s: float,
    ) -> NatsTarget:
        """``auth`` defaults to the environment's; NatsUnavailableError for unreadable
        credentials or bad options."""
        try:
            auth = auth if auth is not None else auth_from_env()
            options = security.connect_options() if security is not None else {}
        except ValueError as exc:  # NatsOptionsError, or unreadable credentials in the environment
            raise NatsUnavailableError(str(exc)) from None
        return cls(url, name, auth, security, options, connect_wait_s, reconnect_time_wait_s)

    def named(self, suffix: str) -> NatsTarget:
        """The same target for a second connection, named ``<name>-<suffix>``."""
        return dataclasses.replace(self, name=f"{self.name}-{suffix}")

    @property
    def shown(self) -> str:
        """The URL as logs and errors show it (credentials redacted)."""
        return redact_url(self.url)

    @property
    def credentials(self) -> str:
        """Which credentials this client presents, as an error names them ("" for none)."""
        if self.auth:
            return f"user {self.auth.user!r}"
        if url_has_credentials(self.url):
            return "the credentials in the URL"
        if self.security is not None and self.security.creds:
            return f"--nats-creds {self.security.creds}"
        return ""

    def refusal(self, server_info: Mapping[str, Any], facts: ConnectionFacts) -> str | None:
        """Why this client's credentials must not go to the server it reached, or None."""
        if not self.credentials:
            return None
        if not server_info.get("auth_required"):
            host, port = facts.theirs or ("", 0)
            return (
                f"the NATS server at {host}:{port}{holder_note(host, port)} asks for no "
                f"credentials, but {self.name} was given some: it is not the server they were "
                "made for (another user's, started first on that port?), and nothing is sent to "
                "it; stop it, or connect without credentials to use an open server"
            )
        trust_network = self.security is not None and self.security.trust_network
        return vet_connection(
            facts.ours, facts.theirs, tls_verified=facts.tls_verified, trust_network=trust_network
        )

    def connect_options(self) -> dict[str, Any]:
        """nats-py's ``connect`` arguments but the callbacks."""
        return {
            # a cluster's members, in the order given: the host's own server first, the others
            # to reconnect to when it goes
            "servers": split_nats_urls(self.url),
            "dont_randomize": True,
            # a silently cut link (no FIN, no RST) is noticed in ~10 s, not nats-py's 4 min
            "ping_interval": 5,
            "max_outstanding_pings": 2,
            "name": self.name,
            "connect_timeout": 2,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": self.reconnect_time_wait_s,
            **(self.auth.connect_options() if self.auth else {}),
            **self.options,
        }


@dataclass(frozen=True, slots=True)
class ConnectionFacts:
    """The socket a client is connecting over: its and the server's address (None when not
    TCP), and whether TLS verified the server."""

    ours: Address | None
    theirs: Address | None
    tls_verified: bool


@dataclass(slots=True)
class FailedConnects:
    """What went wrong while connecting, for the error that gives up."""

    refused: list[str] = dataclasses.field(default_factory=list)  # credentials turned down
    tls: list[str] = dataclasses.field(default_factory=list)
    vetting: list[str] = dataclasses.field(default_factory=list)  # servers we refused


class VettedClient(Client):
    """nats-py's client for ``target``: asks the target before each CONNECT whether this
    connection's server may have the credentials (the first connect fails with
    NatsVettingError, a reconnect attempt with UnverifiedServerError, and is retried), tells
    ``hearing`` of every disconnect and reconnect (shared/bus/hearing.py: an outage is not a
    peer's silence), and logs its events."""

    def __init__(self, target: NatsTarget, hearing: Hearing | None = None) -> None:
        super().__init__()
        self.target = target
        self.hearing = hearing
        self.failed = FailedConnects()
        self.hanging_up = False  # our own close: its disconnect is no outage
        self._connected_once = False  # a refusal after it is a reconnect attempt's
        self.beacon: LivenessBeacon | None = None  # set while worker_presence runs

    def sibling(self, suffix: str) -> contextlib.AbstractAsyncContextManager[VettedClient]:
        """A second connection like this one (same server, credentials and vetting), named
        ``<name>-<suffix>``: the liveness beacon's (shared/bus/liveness.py)."""
        return _connected(self.target.named(suffix), hearing=None)

    async def dial(self) -> None:
        """Connect within the target's ``connect_wait_s``; NatsUnavailableError says why not."""
        try:
            await asyncio.wait_for(
                self.connect(
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                    **self.target.connect_options(),
                ),
                timeout=self.target.connect_wait_s,
            )
        except NatsVettingError as exc:
            await self.hang_up()
            raise NatsUnavailableError(str(exc)) from None
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await self.hang_up()
            raise self._unavailable(exc) from None
        self._connected_once = True

    async def hang_up(self) -> None:
        """Drain (at most 5 s), then close."""
        self.hanging_up = True
        if not self.is_closed:
            if self.is_connected:
                with contextlib.suppress(TimeoutError, nats.errors.Error):
                    await asyncio.wait_for(self.drain(), timeout=5.0)
            if not self.is_closed:
                await self.close()

    def facts(self) -> ConnectionFacts:
        """The socket this client is connecting over (nats-py keeps it in its transport)."""
        transport = self._transport
        bare = getattr(transport, "_bare_io_writer", None)
        wrapped = getattr(transport, "_io_writer", None)
        ours = bare.get_extra_info("sockname") if bare is not None else None
        theirs = bare.get_extra_info("peername") if bare is not None else None
        ssl_object = wrapped.get_extra_info("ssl_object") if wrapped is not None else None
        tls_verified = ssl_object is not None and self.ssl_context.verify_mode == ssl.CERT_REQUIRED
        return ConnectionFacts(_address(ours), _address(theirs), tls_verified)

    def _connect_command(self) -> bytes:
        why = self.target.refusal(self._server_info, self.facts())
        if why is not None:
            if not self.failed.vetting:  # then counted, not logged again each reconnect attempt
                log.error("refusing the NATS server", name=self.target.name, why=why)
            self.failed.vetting.append(why)
            if self._connected_once:
                raise UnverifiedServerError(why)
            raise NatsVettingError(why)
        return super()._connect_command()

    async def _on_error(self, exc: Exception) -> None:
        text = str(exc)
        if isinstance(exc, ssl.SSLError):
            self.failed.tls.append(text)
        if "authorization violation" in text.lower():
            self.failed.refused.append(text)
        if "permissions violation" in text.lower():  # a role sent what it may not
            log.warning("nats refused an operation", name=self.target.name, error=text)
        else:
            log.debug("nats error", name=self.target.name, error=text)

    async def _on_disconnected(self) -> None:
        if self.hanging_up or self.is_closed:
            return
        if self.hearing is not None:
            self.hearing.on_disconnected(time.monotonic())
        log.warning("nats disconnected, reconnecting", name=self.target.name, url=self.target.shown)

    async def _on_reconnected(self) -> None:
        if self.hearing is not None:
            self.hearing.on_reconnected(time.monotonic())
        log.info("nats reconnected", name=self.target.name, url=self.target.shown)

    def _unavailable(self, exc: BaseException) -> NatsUnavailableError:
        """Why the first connect failed, and what to do about it."""
        target, shown = self.target, self.target.shown
        if self.failed.refused:
            return NatsUnavailableError(
                f"the NATS server at {shown} refused {target.credentials or 'no credentials'} "
                "(authorization violation); a mesh started by `kvmesh up` has one user per role: "
                f"set {USER_ENV}={ADMIN} and {PASSWORD_FILE_ENV} to the file `kvmesh up` printed"
            )
        if self.failed.tls or isinstance(exc, ssl.SSLError):
            detail = self.failed.tls[-1] if self.failed.tls else str(exc)
            return NatsUnavailableError(
                f"TLS with the NATS server at {shown} failed ({detail}); check --nats-tls-ca "
                "(the CA that signed the server's certificate), --nats-tls-cert/--nats-tls-key, "
                "and that the URL's host is a name in the certificate"
            )
        return NatsUnavailableError(
            f"no NATS server answered at {shown} within {target.connect_wait_s:g}s "
            f"({type(exc).__name__}: {redact_secrets(str(exc), target.url)}); start one "
            "(`kvmesh up` does, or `nats-server -js`) or pass --nats-url / KVMESH_NATS_URL"
        )


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
) -> AsyncIterator[VettedClient]:
    """A connection for the block: connect (retrying for ``connect_wait_s``), reconnect forever
    after, drain on exit. ``auth``: user and password; default those in the environment
    (shared/bus/nats_auth.py), none on an open server. ``security``: a credentials file and TLS
    (shared/config/nats_options.py); a token or user:password in ``url`` works too. ``hearing``:
    told of every disconnect and reconnect. Logs and errors show ``url`` redacted."""
    target = NatsTarget.resolve(url, name, auth, security, connect_wait_s, reconnect_time_wait_s)
    async with _connected(target, hearing) as nc:
        yield nc


@contextlib.asynccontextmanager
async def _connected(target: NatsTarget, hearing: Hearing | None) -> AsyncIterator[VettedClient]:
    nc = VettedClient(target, hearing)
    await nc.dial()
    try:
        yield nc
    finally:
        await nc.hang_up()


async def flush_to_server(nc: Client) -> None:
    """Return once the server has processed everything ``nc`` sent so far (subscriptions made,
    messages published). nats-py's ``flush()`` writes its PING straight to the socket, ahead of
    the commands still queued for its flusher task (a SUB or PUB just made), so its PONG alone
    does not prove they arrived: the server may see the SUB after the PING. The first round
    trip lets the flusher write the queue (it runs while this task waits for the PONG); the
    second PING follows it on the socket, so its PONG comes after they were processed."""
    await nc.flush()
    await nc.flush()


def _address(sockaddr: object) -> Address | None:
    """(host, port) of an AF_INET or AF_INET6 socket address; None for anything else."""
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return str(sockaddr[0]), int(sockaddr[1])
    return None
