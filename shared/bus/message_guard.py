"""The one door every NATS message comes through: no message, however made, takes a service down.

A message is data from whoever may publish on a subject (a stray publisher, another version, a
compromised role). Each subscription callback and each micro endpoint handler of a service is
wrapped here (``subscriptions`` and ``guarded_subscribe`` in shared/bus/nats_subscribe.py,
``open_for_requests`` in shared/bus/nats_request.py), and each task a handler spawns runs through ``spawn``:

- a body over ``max_bytes`` is refused before it is decoded (``oversized``);
- a body that does not decode as the route's message type is refused (``malformed``): the
  typed routes decode here, the raw ones decode in their handler and drop it themselves;
- a request without a reply subject is refused before its handler runs (``no_reply``): it
  could never be answered, and a handler that reserved something for it would hold it until
  a lease ran out (a decode worker's reserve raised "no reply subject set" out of its task
  group and the process exited);
- a request whose reply subject is not an inbox is refused before its handler runs
  (``bad_reply``): a reply goes out under ``allow_responses``, which lets the responder publish
  on whatever reply subject the request named, so a kv-store put with ``reply=registry.advertise``
  made the store publish there (issue 40). Replies go only to ``_INBOX.…`` (a mesh without
  credentials) or a role's own ``_INBOX_<role>.…`` (``shared/bus/nats_auth.inbox_prefix``);
- whatever a handler or a spawned task raises is logged and counted (``failed``); a request is
  answered with an error (500) when it can be.

A refusal is counted in ``kvmesh_<service>_nats_refused_total{reason}`` (once a service binds its
counter: ``count_into``) and logged as a warning, at most one line per reason per
``LOG_EVERY_S`` (a flood of bad messages does not flood the log: the next line says how many
were refused since). Replays need no rule here: every handler already treats a repeated message
as the state it has (a second reserve of a request is refused, a second done is ignored).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from kvmesh.shared.bus.messages.codec import MessageError, decode_message
from kvmesh.shared.bus.nats_auth import ROLES
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from prometheus_client import Counter

log = logs.get_logger(__name__)

M = TypeVar("M")
REASONS = ("oversized", "malformed", "no_reply", "bad_reply", "failed")
# NATS's default max_payload: nothing larger arrives from a default server; a server configured
# for more still does not hand a service a body it would spend seconds decoding
MAX_MESSAGE_BYTES = 1 << 20
LOG_EVERY_S = 1.0


class MessageGuard:
    """Counts and logs refused messages, and wraps handlers so that none of them can raise."""

    def __init__(self, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
        assert max_bytes > 0, max_bytes
        self.max_bytes = max_bytes
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._counter: Counter | None = None
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = dict.fromkeys(REASONS, 0)

    def count_into(self, counter: Counter) -> None:
        """Count refusals into ``counter`` (labelled by reason) from now, and those so far."""
        if self._counter is counter:
            return
        self._counter = counter
        for reason, n in self.counts.items():
            counter.labels(reason).inc(n)

    def refuse(self, reason: str, subject: str, detail: str, *, exc_info: bool = False) -> None:
        assert reason in REASONS, reason
        self.counts[reason] += 1
        if self._counter is not None:
            self._counter.labels(reason).inc()
        now = time.monotonic()
        if now - self._logged_at.get(reason, -LOG_EVERY_S) < LOG_EVERY_S:
            self._unlogged[reason] += 1
            return
        self._logged_at[reason] = now
        since, self._unlogged[reason] = self._unlogged[reason], 0
        log.warning(
            # a handler that raised took the message in: its error is the service's, not the
            # message's (a broken TP group, a lost connection), and is said so
            "handling a NATS message failed" if reason == "failed" else "refused a NATS message",
            reason=reason,
            subject=subject,
            error=detail,
            **({"also_refused_since": since} if since else {}),
            exc_info=exc_info,
        )

    def _unanswerable(self, subject: str, reply: str) -> bool:
        """Refuse (and count) a request that has no reply subject, or one that is no inbox."""
        if not reply:
            self.refuse("no_reply", subject, "a request without a reply subject")
            return True
        if not is_inbox(reply):
            self.refuse("bad_reply", subject, f"a reply subject that is no inbox: {reply[:80]!r}")
            return True
        return False

    def _oversized(self, msg: Msg) -> bool:
        if len(msg.data) <= self.max_bytes:
            return False
        self.refuse("oversized", msg.subject, f"{len(msg.data)} bytes > {self.max_bytes}")
        return True

    def typed(
        self, cls: type[M], handle: Callable[[M], Awaitable[None]]
    ) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback: decode each message as ``cls``, then ``handle`` it."""

        async def callback(msg: Msg) -> None:
            if self._oversized(msg):
                return
            try:
                body = decode_message(msg.data, cls)
            except MessageError as exc:
                self.refuse("malformed", msg.subject, str(exc))
                return
            await self._contained(handle(body), msg.subject)

        return callback

    def raw(
        self, handle: Callable[[Msg], Awaitable[None]], *, needs_reply: bool = False
    ) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback for a handler that reads the message itself; one that
        ``needs_reply`` (a request on a plain subscription) gets none without a reply subject."""

        async def callback(msg: Msg) -> None:
            if needs_reply and self._unanswerable(msg.subject, msg.reply):
                return
            if not self._oversized(msg):
                await self._contained(handle(msg), msg.subject)

        return callback

    def request(
        self, handle: Callable[[Request], Awaitable[None]]
    ) -> Callable[[Request], Awaitable[None]]:
        """A micro endpoint handler: refuse what cannot or must not be answered, contain the
        rest (a handler that fails answers 500)."""

        async def handler(req: Request) -> None:
            if self._unanswerable(req.subject, req._msg.reply):  # nats-py keeps it there only
                return
            if len(req.data) > self.max_bytes:
                self.refuse("oversized", req.subject, f"{len(req.data)} bytes > {self.max_bytes}")
                await self._answer_error(req, "413", f"a request over {self.max_bytes} bytes")
                return
            if not await self._contained(handle(req), req.subject):
                await self._answer_error(req, "500", "the request could not be handled")

        return handler

    def spawn(self, tg: asyncio.TaskGroup, coro: Coroutine[Any, Any, None], subject: str) -> None:
        """Run a handler's work as a task of ``tg`` that cannot fail the group."""
        tg.create_task(self._contained(coro, subject))

    async def _contained(self, coro: Awaitable[None], subject: str) -> bool:
        """Await ``coro``; False when it raised (logged and counted, never propagated)."""
        try:
            await coro
        except Exception as exc:  # anything a message provoked: the service goes on
            self.refuse("failed", subject, f"{type(exc).__name__}: {exc}", exc_info=True)
            return False
        return True

    @staticmethod
    async def _answer_error(req: Request, code: str, description: str) -> None:
        try:
            await req.respond_error(code, description)
        except Exception as exc:  # the requester is gone, or the connection is
            log.debug("error answer not sent", subject=req.subject, error=str(exc))


def is_inbox(reply: str) -> bool:
    """Whether ``reply`` is a requester's inbox: ``_INBOX.<token>…`` (nats-py's default, a mesh
    without credentials) or ``_INBOX_<role>.<token>…`` of a kvmesh role. Nothing else a service
    answers on: a subject of the mesh, ``$JS.…`` or ``$SRV.…`` is refused."""
    head, dot, rest = reply.partition(".")
    if not dot or not rest:
        return False
    return head == "_INBOX" or (head.startswith("_INBOX_") and head[len("_INBOX_") :] in ROLES)


def guard_of(nc: Client) -> MessageGuard:
    """The guard of connection ``nc`` (one per connection: ``connect_nats`` makes it); a plain
    client a test made gets one on first use."""
    guard = getattr(nc, "kvmesh_guard", None)
    if guard is None:
        guard = MessageGuard()
        nc.kvmesh_guard = guard  # type: ignore[attr-defined]
    return guard
