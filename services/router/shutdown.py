"""Stopping the router without cutting a response off mid-way.

On SIGTERM the router stops taking requests (503) and gives the ones in flight a grace period to
finish. Whatever still runs after it is interrupted where it stands: the interruption surfaces as
a ``RouterStoppingError`` inside the request's handler, so a stream ends with an SSE error event
and ``[DONE]``, a plain request with a JSON 503, and the request's mesh work is aborted on the way
out (``Dispatcher.open`` publishes ``Abort``), so decode workers free its blocks at once.

The interruption is a task cancellation that only this module's guard turns into an error: a
client that goes away still cancels its handler as before (an abort, no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kvmesh.services.router.errors import ServiceUnavailableError


class RouterStoppingError(ServiceUnavailableError):
    """503: the router is shutting down; another router (or this one, restarted) will serve."""

    default_code = "router_stopping"


STOPPING_MESSAGE = (
    "the router is shutting down; send the request again (to another router, or to this one "
    "once it is back)"
)


class Shutdown:
    """Which requests a stop must wait for or interrupt, and the stop itself."""

    def __init__(self) -> None:
        self.is_stopping = False
        self._running: set[asyncio.Task] = set()
        self._interrupted: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    def check_open(self) -> None:
        """Refuse a new request once the stop has begun."""
        if self.is_stopping:
            raise RouterStoppingError(STOPPING_MESSAGE, retry_after_s=1.0)

    @contextlib.asynccontextmanager
    async def guard(self) -> AsyncIterator[None]:
        """The part of a request a stop may interrupt (its time on the mesh). An interruption
        leaves the block as ``RouterStoppingError``; any other cancellation stays one."""
        self.check_open()
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        self._idle.clear()
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._interrupted:
                raise
            task.uncancel()
            raise RouterStoppingError(STOPPING_MESSAGE, retry_after_s=1.0) from None
        finally:
            self._running.discard(task)
            self._interrupted.discard(task)
            if not self._running:
                self._idle.set()

    async def stop(self, grace_s: float, settle_s: float = 2.0) -> int:
        """Refuse new requests, wait up to ``grace_s`` for the running ones, then interrupt the
        rest and wait up to ``settle_s`` for them to end. Returns how many were interrupted."""
        self.is_stopping = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        interrupted = list(self._running)
        for task in interrupted:
            self._interrupted.add(task)
            task.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), settle_s)
        return len(interrupted)
