"""A worker feature as its service shell sees it: what it subscribes to, what it sends, what it
adds to the worker's advert, and how it closes (docs/ARCHITECTURE.md, "Worker features").

A feature is one object of its own module (speculation, kv-store puts, swaps, prefix reads,
cache reports, draft KV), composed from the config by the service's ``compose.py``. The shell
never names one: it loops over its ``Features``, wiring each at ``Site`` (the NATS client, the
mesh's subjects, the worker's id). How a feature joins the worker's engine loop is the service's
own hook type (``services/decode/step_hooks.py``: ``StepHook``; ``services/prefill/job_hooks.py``:
``JobHook``), both subclasses of ``Feature``.

Every method has a default that does nothing, so a feature implements only what it uses:

- ``routes(site)``: ``(subject, message type, handler)`` subscriptions, opened with the worker's;
- ``contexts(site)``: async context managers entered once its subscriptions are open (a solicit
  for the kv-stores' adverts);
- ``loops(site)``: task bodies run for the worker's life (a periodic report);
- ``outbox(subjects)``: the messages it queued, ``(subject, message)``, which the shell sends
  after each engine step (decode) and nothing waits for;
- ``advert()``: the fields of the worker's advert it sets (a decode worker's: of its ``DecodeReach``);
- ``aclose()``: wait for its background work; called in reverse composition order, after the
  worker stopped and before the NATS client closes.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats.errors
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.nats_subscribe import Handler
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client

log = logs.get_logger(__name__)

Route = tuple[str, type[Any], Handler]
Loop = Callable[[], Coroutine[Any, Any, Any]]
Outbound = tuple[str, msgspec.Struct]  # (subject, message)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Site:
    """Where a feature is wired in: the worker's NATS client, its mesh's subjects, its id."""

    nc: Client
    subjects: Subjects
    worker_id: str


class Feature:
    """A worker feature (module docstring). Every method is optional: the base does nothing."""

    def routes(self, site: Site) -> Sequence[Route]:
        return ()

    def contexts(self, site: Site) -> Sequence[AbstractAsyncContextManager[Any]]:
        return ()

    def loops(self, site: Site) -> Sequence[Loop]:
        return ()

    def outbox(self, subjects: Subjects) -> list[Outbound]:
        return []

    def advert(self) -> Mapping[str, Any]:
        return {}

    async def aclose(self) -> None:
        return None


class Features(tuple[Feature, ...]):
    """A worker's features in composition order: what the shell wires, sends and closes."""

    def __new__(cls, features: Iterable[Feature] = ()) -> Features:
        return super().__new__(cls, features)

    def of_type(self, kind: type[T]) -> list[T]:
        """The features that are also a ``kind`` (a service's hook type), in order."""
        return [f for f in self if isinstance(f, kind)]

    def routes(self, site: Site) -> tuple[Route, ...]:
        return tuple(route for f in self for route in f.routes(site))

    def contexts(self, site: Site) -> tuple[AbstractAsyncContextManager[Any], ...]:
        return tuple(context for f in self for context in f.contexts(site))

    def loops(self, site: Site) -> tuple[Loop, ...]:
        return tuple(loop for f in self for loop in f.loops(site))

    def advert(self) -> dict[str, Any]:
        """Every feature's advert fields; two that set the same field is a composition bug."""
        fields: dict[str, Any] = {}
        for f in self:
            for name, value in f.advert().items():
                if name in fields:
                    raise ValueError(f"two features set the advert's {name!r}")
                fields[name] = value
        return fields

    async def send(self, nc: Client, subjects: Subjects) -> None:
        """Send what the features queued. Best effort: a message that cannot go out now is
        logged and dropped (nothing waits for one)."""
        for f in self:
            for subject, message in f.outbox(subjects):
                try:
                    await nc.publish(subject, encode_message(message))
                except nats.errors.Error as exc:
                    log.debug("feature message not sent", subject=subject, error=str(exc))

    async def aclose(self) -> None:
        """Close every feature, the last composed first (a later one may use an earlier one's
        client: swaps close before the puts that close the kv-store client)."""
        for f in reversed(self):
            await f.aclose()
