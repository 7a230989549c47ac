"""Heartbeats a slow step cannot starve: a thread of their own, on a NATS connection of their own
(issue 40).

A service's heartbeat used to be a task on its event loop, so anything that held the loop for a
few heartbeat intervals (a grammar built inline took 8 s) silenced it: the registry dropped a
worker that was only busy, and the mesh failed its streams. ``LivenessBeacon`` publishes the
heartbeats from a daemon thread running its own event loop and its own connection (made by the
service's ``connect_nats``, so the same credentials and the same check of the server before
CONNECT, shared/bus/nats_vetting.py). What it publishes is a snapshot the service's loop
records (``record``, thread-safe): the loop's ticker records a fresh heartbeat every interval,
and that record is also the proof that the loop runs.

Two kinds of silence, told apart by a watchdog on that proof:

- the loop is busy (a long step, a slow request): the thread keeps beating the latest snapshot
  (its ``sent_at`` fresh), and the worker stays in the mesh, up to ``stall_limit_s``;
- the loop has not recorded for more than ``stall_limit_s`` (deadlocked, or wedged for good): the
  thread stops beating, and the mesh drops the worker after its missed heartbeats, as if it had
  died. A process that is dead or stopped (SIGSTOP) beats from no thread at all.

A worker's changed state (``kvmesh admin drain``) is announced at once through the beacon's own
connection (``announce``), flushed before the control request is answered, so that every
heartbeat of a worker travels on one connection, in order (a beat of the old state can never
overtake the announcement of the new).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import msgspec
import nats.errors
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.workers import WorkerHeartbeat
from kvmesh.shared.obs import logs
from nats.aio.client import Client

log = logs.get_logger(__name__)

OpenConnection = Callable[[], AbstractAsyncContextManager[Client]]

START_TIMEOUT_S = 30.0  # the beacon's connection (connect_nats waits 10 s for a server)
ANNOUNCE_TIMEOUT_S = 2.0  # then the announcement goes on the service's own connection


class LivenessError(RuntimeError):
    """The beacon's connection could not be made (the message says why)."""


class LivenessBeacon:
    """Publishes ``subject``'s heartbeats every ``interval_s`` from a thread of its own (module
    docstring). ``record`` and ``announce`` are for the service's loop; the rest runs in the
    beacon's thread. ``clock`` is monotonic seconds (tests pass their own)."""

    def __init__(
        self,
        open_connection: OpenConnection,
        subject: str,
        first: WorkerHeartbeat,
        *,
        interval_s: float,
        stall_limit_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < interval_s < stall_limit_s:
            raise ValueError(
                f"the heartbeat interval ({interval_s:g} s) must be positive and shorter than the "
                f"loop's stall limit ({stall_limit_s:g} s, --loop-stall-limit-s)"
            )
        self.subject = subject
        self.interval_s = interval_s
        self.stall_limit_s = stall_limit_s
        self._open = open_connection
        self._clock = clock
        self._lock = threading.Lock()
        self._latest = first
        self._recorded_at = clock()
        self._stalled = False  # logged once per stall
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nc: Client | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name=f"liveness {subject}", daemon=True)
        self.beats = 0  # published by the thread (a counter for tests and logs)

    # --- the service's loop ----------------------------------------------------------------------

    def record(self, beat: WorkerHeartbeat) -> None:
        """The loop's latest heartbeat, and the proof that the loop runs (thread-safe)."""
        with self._lock:
            self._latest = beat
            self._recorded_at = self._clock()

    async def ticker(self, make_heartbeat: Callable[[], WorkerHeartbeat]) -> None:
        """Record ``make_heartbeat()`` every interval (a task body on the service's loop)."""
        while True:
            self.record(make_heartbeat())
            await asyncio.sleep(self.interval_s)

    async def announce(self, beat: WorkerHeartbeat) -> bool:
        """Record ``beat`` and publish it now on the beacon's connection, returning once the
        server has processed it (True); False if that connection could not within
        ``ANNOUNCE_TIMEOUT_S`` (reconnecting: the caller publishes it itself)."""
        self.record(beat)
        loop = self._loop
        if loop is None or self._failure is not None:
            return False
        future = asyncio.run_coroutine_threadsafe(self._publish(beat, flush=True), loop)
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), ANNOUNCE_TIMEOUT_S)
        except (TimeoutError, nats.errors.Error, concurrent.futures.CancelledError) as exc:
            log.debug("heartbeat not announced on the liveness connection", error=str(exc))
            return False
        return True

    # --- lifecycle (the service's loop) ----------------------------------------------------------

    async def start(self) -> None:
        """Start the thread; returns once its connection is up. LivenessError if it fails."""
        self._thread.start()
        started = await asyncio.to_thread(self._started.wait, START_TIMEOUT_S)
        if self._failure is not None:
            raise LivenessError(f"the heartbeat connection failed: {self._failure}")
        if not started:
            raise LivenessError(f"the heartbeat connection was not up within {START_TIMEOUT_S:g} s")

    async def stop(self) -> None:
        """Stop beating, close the beacon's connection and end its thread."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                loop.call_soon_threadsafe(stop.set)
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10.0)

    # --- the beacon's thread ---------------------------------------------------------------------

    def due(self) -> WorkerHeartbeat | None:
        """The heartbeat to publish now: the latest recorded, sent now; None while the loop has
        not recorded for more than ``stall_limit_s`` (the worker is to be dropped)."""
        with self._lock:
            beat, silent_s = self._latest, self._clock() - self._recorded_at
        if silent_s > self.stall_limit_s:
            if not self._stalled:
                log.error(
                    "event loop stalled past the limit: heartbeats stop, the mesh drops this "
                    "worker (--loop-stall-limit-s)",
                    worker_id=beat.worker_id,
                    stalled_s=round(silent_s, 1),
                    limit_s=self.stall_limit_s,
                )
            self._stalled = True
            return None
        if self._stalled:
            log.warning("event loop runs again: heartbeats resume", worker_id=beat.worker_id)
            self._stalled = False
        elif silent_s > 2 * self.interval_s:
            log.debug("event loop busy, heartbeating for it", stalled_s=round(silent_s, 1))
        return msgspec.structs.replace(beat, sent_at=time.time())

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failure = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        async with self._open() as nc:
            self._nc = nc
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._started.set()
            while not self._stop.is_set():
                beat = self.due()
                if beat is not None:
                    try:
                        await self._publish(beat, flush=False)
                    except nats.errors.Error as exc:  # reconnecting: the next beat tries again
                        log.debug("heartbeat not sent", error=str(exc))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
            self._loop = None

    async def _publish(self, beat: WorkerHeartbeat, *, flush: bool) -> None:
        nc = self._nc
        assert nc is not None
        await nc.publish(self.subject, encode_message(beat))
        self.beats += 1
        if flush:  # twice, as nats_connect.flush_to_server: the PUB is processed, not only sent
            await nc.flush()
            await nc.flush()


@contextlib.asynccontextmanager
async def liveness_beacon(
    open_connection: OpenConnection,
    subject: str,
    make_heartbeat: Callable[[], WorkerHeartbeat],
    *,
    interval_s: float,
    stall_limit_s: float,
) -> AsyncIterator[LivenessBeacon]:
    """A started ``LivenessBeacon`` fed by a ticker on this loop, for the duration of the
    block; stopped (thread ended, connection drained) on exit."""
    beacon = LivenessBeacon(
        open_connection,
        subject,
        make_heartbeat(),
        interval_s=interval_s,
        stall_limit_s=stall_limit_s,
    )
    await beacon.start()
    try:
        ticker = asyncio.create_task(beacon.ticker(make_heartbeat))
        try:
            yield beacon
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
    finally:
        await beacon.stop()
