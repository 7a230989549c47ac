"""Every request a decode worker holds, one entry each, from its reservation to its final event.

A request enters in one of two ways and ends exactly once:

- a local prefill is ``READING`` (its prefix read from a kv-store first, ``local_reads.py``) or
  ``QUEUED`` (added to the engine by the next ``admit()``);
- a remote prefill is ``RESERVED`` (its blocks written under a write lease: ``pending.py`` holds
  the lease), then ``SETTLED`` once its lease has a verdict (applied by the next ``admit()``:
  admitted, or failed);
- both are ``RUNNING`` once in the engine, and ``ABORTING`` while an abort waits for the next
  ``admit()`` to reach the engine.

An entry ends with the request's final event (``end``), or without one where none is owed (a
reservation whose lease is dropped without word: the request lives elsewhere). Each entry also
holds the router instance streaming it (dropped when that router is gone) and, once its router
is gone, the time its stream is aborted unless another router takes it over (``hand_over``).

Verdicts that only give blocks back (a quarantine ending, a lease the registry gave up on) are
no request's any more: they wait in ``releases`` for the next ``admit()``. The table also
remembers, for a while, the requests aborted and the leases cancelled lately, so that a late
reservation for one is refused rather than held for nobody.

Pure and synchronous, the clock passed in: the worker asks it where a request is and acts on the
engine, the lease table and the reads accordingly.
"""

from __future__ import annotations

import enum
from collections.abc import Container
from dataclasses import dataclass

from kvmesh.services.decode.pending import Verdict
from kvmesh.shared.bus.recent_ids import RecentIds
from kvmesh.shared.text.sampling import SamplingOptions


class RequestPhase(enum.Enum):
    READING = "reading"  # local prefill: its prefix read from a kv-store first
    QUEUED = "queued"  # local prefill: added to the engine by the next admit()
    RESERVED = "reserved"  # remote prefill: its blocks being written under a lease
    SETTLED = "settled"  # remote prefill: its lease's verdict, applied by the next admit()
    RUNNING = "running"  # in the engine: its final event ends it
    ABORTING = "aborting"  # in the engine: its abort reaches the engine with the next admit()


@dataclass(slots=True, eq=False)
class RequestEntry:
    request_id: str
    phase: RequestPhase
    prompt: tuple[int, ...] = ()
    params: SamplingOptions | None = None
    router: str = ""  # the router instance streaming it ("": none, or none any more)
    lease_id: str = ""  # a QUEUED local prefill's (the registry may cancel it)
    verdict: Verdict | None = None  # SETTLED: its lease's verdict
    settled_at: float | None = None  # SETTLED: when the verdict came (its admission wait)
    detached_until: float | None = None  # its router is gone: aborted then, unless taken over


class RequestTable:
    def __init__(self, recent_s: float = 120.0) -> None:
        self._entries: dict[str, RequestEntry] = {}
        # phase -> its entries, in the order they reached it (admit() goes in that order)
        self._phases: dict[RequestPhase, dict[str, RequestEntry]] = {
            phase: {} for phase in RequestPhase
        }
        self._releases: list[Verdict] = []
        self._stray_aborts: list[str] = []  # aborts of requests not held here, for the engine
        self.aborted = RecentIds(recent_s)  # requests aborted lately
        self.cancelled_leases = RecentIds(recent_s)  # leases the registry gave up on lately

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> RequestEntry | None:
        return self._entries.get(request_id)

    def in_phase(self, phase: RequestPhase) -> list[RequestEntry]:
        """The entries in ``phase``, in the order they reached it."""
        return list(self._phases[phase].values())

    def count(self, phase: RequestPhase) -> int:
        return len(self._phases[phase])

    @property
    def num_detached(self) -> int:
        return sum(1 for e in self._entries.values() if e.detached_until is not None)

    @property
    def needs_admit(self) -> bool:
        """Something for the next ``admit()``: a request queued or settled, blocks to give
        back, an abort for the engine."""
        phases = self._phases
        return bool(
            phases[RequestPhase.QUEUED]
            or phases[RequestPhase.SETTLED]
            or phases[RequestPhase.ABORTING]
            or self._releases
            or self._stray_aborts
        )

    def refusal(self, request_id: str, lease_id: str, now: float) -> str:
        """Why a reservation for ``request_id`` under ``lease_id`` is refused ("" if not)."""
        if self.aborted.seen(request_id, now):
            return f"request {request_id!r} was aborted before its reservation arrived"
        if self.cancelled_leases.seen(lease_id, now):
            return f"the registry gave up on lease {lease_id} before it arrived"
        return ""

    # ---- entering -----------------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        phase: RequestPhase,
        prompt: tuple[int, ...],
        params: SamplingOptions,
        *,
        router: str = "",
        lease_id: str = "",
    ) -> RequestEntry:
        """A request accepted: a local prefill (READING or QUEUED) or a reservation (RESERVED)."""
        if phase not in (RequestPhase.READING, RequestPhase.QUEUED, RequestPhase.RESERVED):
            raise ValueError(f"a request enters reading, queued or reserved, not {phase.value}")
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} is already in the table")
        entry = RequestEntry(request_id, phase, tuple(prompt), params, router, lease_id)
        self._entries[request_id] = entry
        self._phases[phase][request_id] = entry
        return entry

    # ---- transitions --------------------------------------------------------------------------

    def _move(self, entry: RequestEntry, to: RequestPhase) -> None:
        del self._phases[entry.phase][entry.request_id]
        entry.phase = to
        self._phases[to][entry.request_id] = entry

    def _expect(self, request_id: str, *phases: RequestPhase) -> RequestEntry:
        entry = self._entries.get(request_id)
        assert entry is not None and entry.phase in phases, (request_id, entry, phases)
        return entry

    def read_ended(self, request_id: str) -> None:
        """A local prefill's prefix read ended: READING -> QUEUED."""
        self._move(self._expect(request_id, RequestPhase.READING), RequestPhase.QUEUED)

    def settle(self, verdict: Verdict, now: float) -> None:
        """A reservation's lease has a verdict: RESERVED -> SETTLED when it is to be admitted or
        its client told; one that owes nobody a word ends here, its blocks in ``releases``."""
        entry = self._entries.get(verdict.lease.request_id)
        if entry is None or entry.phase is not RequestPhase.RESERVED:
            self._releases.append(verdict)  # a quarantine ending: the request ended already
        elif verdict.ok or verdict.notify:
            entry.verdict, entry.settled_at = verdict, now
            self._move(entry, RequestPhase.SETTLED)
        else:
            self._remove(entry)
            self._releases.append(verdict)

    def take_releases(self) -> list[Verdict]:
        releases, self._releases = self._releases, []
        return releases

    def started(self, request_id: str) -> None:
        """In the engine now: QUEUED or SETTLED -> RUNNING."""
        entry = self._expect(request_id, RequestPhase.QUEUED, RequestPhase.SETTLED)
        entry.verdict, entry.lease_id = None, ""
        self._move(entry, RequestPhase.RUNNING)

    def abort(self, request_id: str, now: float) -> RequestPhase | None:
        """The client went away: returns the phase the request was in (None: unknown here). Its
        stream is nobody's from now on. READING and QUEUED: it ends (its final event is the
        caller's to give); RESERVED: it stays until its lease has a verdict; SETTLED: its verdict
        is marked aborted (it is failed, not admitted); RUNNING: ABORTING. Unknown: no entry,
        but the abort goes to the engine too (it may hold further choices of an ended one)."""
        self.aborted.add(request_id, now)
        entry = self._entries.get(request_id)
        if entry is None:  # not a request held here: only the engine may hold choices of it
            self._stray_aborts.append(request_id)
            return None
        was = entry.phase
        entry.router, entry.detached_until = "", None
        if was in (RequestPhase.READING, RequestPhase.QUEUED):
            self._remove(entry)
        elif was is RequestPhase.SETTLED:
            assert entry.verdict is not None
            entry.verdict.lease.is_aborted = True
        elif was is RequestPhase.RUNNING:
            self._move(entry, RequestPhase.ABORTING)
        return was

    def take_aborting(self) -> list[str]:
        """The aborts to take to the engine now: ABORTING -> RUNNING (its final event follows;
        ``end`` it at once where the engine held nothing of it)."""
        aborting = self.in_phase(RequestPhase.ABORTING)
        for entry in aborting:
            self._move(entry, RequestPhase.RUNNING)
        stray, self._stray_aborts = self._stray_aborts, []
        return [entry.request_id for entry in aborting] + stray

    def cancel_queued(self, request_id: str, lease_id: str, now: float) -> bool:
        """The registry gave up on ``lease_id``: remembered, and a QUEUED local prefill accepted
        under it ends (no final event: the request lives elsewhere). True if one did."""
        self.cancelled_leases.add(lease_id, now)
        entry = self._entries.get(request_id)
        if entry is None or entry.phase is not RequestPhase.QUEUED or entry.lease_id != lease_id:
            return False
        self._remove(entry)
        return True

    def end(self, request_id: str) -> None:
        """The request's final event was given (or none is owed): its entry goes."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._remove(entry)

    def _remove(self, entry: RequestEntry) -> None:
        del self._entries[entry.request_id]
        del self._phases[entry.phase][entry.request_id]

    # ---- streams and their routers --------------------------------------------------------------

    def of_router(self, router: str) -> list[RequestEntry]:
        """The requests the router instance ``router`` streams."""
        return [e for e in self._entries.values() if router and e.router == router]

    def router_gone(
        self, router: str, now: float, streaming: Container[str], resume_window_s: float
    ) -> list[str]:
        """The router instance ``router`` is gone: nobody reads its requests' tokens any more.
        Those ``streaming`` (tokens out already) are detached for ``resume_window_s`` (> 0),
        as their clients may resume them through another router; returns the others, for the
        caller to abort."""
        doomed = []
        for entry in self.of_router(router):
            entry.router = ""
            if entry.request_id in streaming and resume_window_s > 0:
                entry.detached_until = now + resume_window_s
            else:
                doomed.append(entry.request_id)
        return doomed

    def hand_over(self, request_id: str, router: str) -> bool:
        """The router instance ``router`` took over the stream (a client resumed it there):
        a request streamed by a router, or detached, is ``router``'s from now on."""
        entry = self._entries.get(request_id)
        if entry is None or not (entry.router or entry.detached_until is not None):
            return False
        entry.router, entry.detached_until = router, None
        return True

    def take_expired_detached(self, now: float) -> list[str]:
        """The detached requests whose resume window is over (no longer detached: the caller
        aborts them)."""
        expired = [
            e
            for e in self._entries.values()
            if e.detached_until is not None and now >= e.detached_until
        ]
        for entry in expired:
            entry.detached_until = None
        return [entry.request_id for entry in expired]
