"""Subscribing: every message a service hears comes through its connection's MessageGuard
(shared/bus/message_guard.py), so a malformed or oversized one (another version's, a stray
publisher's) is refused and what a handler raises is logged and counted. A message is data,
never a reason for a service to fail."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats
from kvmesh.shared.bus.message_guard import guard_of
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

M = TypeVar("M")
Handler = Callable[[Any], Awaitable[None]]


def on_message(
    nc: Client, cls: type[M], handle: Callable[[M], Awaitable[None]]
) -> Callable[[Msg], Awaitable[None]]:
    """A subscription callback: decodes each message as ``cls`` and awaits ``handle(message)``,
    through ``nc``'s MessageGuard."""
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
