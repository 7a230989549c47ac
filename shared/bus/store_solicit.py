"""Store discovery at start: a store reader that starts (a prefill or decode worker that reads or
writes kv-stores, the kv-registry) asks every kv-store to advertise at once (``StoreSolicit`` on
``REGISTRY_STORE_SOLICIT``) instead of waiting up to one heartbeat for its adverts; a store
answers at once, at most once every ``MIN_INTERVAL_S`` (docs/kv_store.md)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import nats.errors
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.kv_store import StoreSolicit
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client

log = logs.get_logger(__name__)

MIN_INTERVAL_S = 0.1  # a store answers at most one solicit in this long


@contextlib.asynccontextmanager
async def store_adverts_solicited(
    nc: Client, subjects: Subjects, sender: str
) -> AsyncIterator[None]:
    """Ask every kv-store for its advert now, on entering the block (enter it once the caller's
    subscription to ``REGISTRY_STORE_ADVERTISE`` is open). A publish that fails (NATS
    reconnecting) is logged: the stores' next heartbeat adverts come anyway."""
    try:
        await nc.publish(subjects.REGISTRY_STORE_SOLICIT, encode_message(StoreSolicit(sender)))
    except nats.errors.Error as exc:
        log.debug("store solicit not sent", error=str(exc))
    yield


class SolicitLimiter:
    """Whether a store answers a solicit now: at most once every ``min_interval_s``. A solicit
    within that of the last one answered is not answered again (a flood costs one advert per
    interval); its sender gets the advert already sent or the next heartbeat's."""

    def __init__(
        self, min_interval_s: float = MIN_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert min_interval_s >= 0, min_interval_s
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._last: float | None = None

    def answer(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last < self.min_interval_s:
            return False
        self._last = now
        return True
