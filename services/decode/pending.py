"""Requests whose KV a prefill worker is writing into this decode worker: the pending table.

A reservation is a write lease (kvmesh.shared.mesh.write_lease: the rules for immediates, the
announcement, expiry and quarantine) on decode blocks, plus what the engine needs to admit the
request once its prefill is in. Each write of the prefill is one chunk: ``(slot, chunk)``
immediates, then ``PrefillDone(num_writes, first_token)``. An expired reservation is reported to
the client at once but its blocks are *quarantined*: a prefill that is merely late may still be
writing into them. On top of the lease rules: the client may go away (abort: the blocks wait
for the prefill to stop writing), the holder may renew its lease, and a prefill worker the
registry drops fails its reservations at once. Pure and synchronous: the service feeds it events
and acts on what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.mesh.write_lease import (
    LeaseVerdict,
    WriteLease,
    WriteLeaseError,
    WriteLeaseTable,
)
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions

log = logs.get_logger(__name__)


class ReservationError(WriteLeaseError):
    """A reservation that cannot be recorded as asked (duplicate request id, busy slot)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What the engine needs to admit a reservation once its prefill is in: the prompt the prefill
    computed and the request's sampling parameters."""

    prompt_ids: tuple[int, ...]
    params: SamplingOptions


@dataclass(slots=True, eq=False)
class Reservation(WriteLease):
    """A write lease on decode blocks; its writes are the prefill's chunks."""

    admission: Admission | None = None  # None only for a table used bare (tests)
    is_aborted: bool = False  # the client went away; blocks wait for the prefill to stop writing
    writer: str = ""  # the prefill worker that took the job (its PrefillStarted), if known


Verdict = LeaseVerdict  # of a Reservation


class PendingTable(WriteLeaseTable[Reservation]):
    """request id -> Reservation, plus slot -> request id for the immediates."""

    error_type = ReservationError
    noun = "a reservation"
    lease_type = Reservation  # add(..., admission=Admission(...))

    def reservations(self) -> list[Reservation]:
        return self.leases()

    def renew(self, request_id: str, lease_id: str, deadline: float) -> bool:
        """The holder of a live lease says it still wants the blocks: the deadline moves to
        ``deadline`` (never earlier). False for an unknown, expired or foreign lease."""
        res = self.get(request_id)
        if res is None or res.lease_id != lease_id or res.is_expired or res.is_aborted:
            return False
        res.deadline = max(res.deadline, deadline)
        return True

    def _ready_error(self, res: Reservation) -> str:
        if res.is_aborted:
            return "aborted"
        assert res.done is not None
        if res.done.first_token < 0:
            return "prefill reported success without a first token"
        return ""

    def _expiry_error(self, res: Reservation) -> str:
        if res.is_aborted:
            return "aborted"
        return (
            f"prefill did not complete before the lease ran out "
            f"({res.num_writes} KV writes arrived, "
            f"{'PrefillDone received' if res.done else 'no PrefillDone'})"
        )

    def _from_holder(self, res: Reservation, keys: frozenset[int] | None, peer_id: str) -> bool:
        """``keys`` must hold the reservation's window key; where the transport cannot tell
        (None: rdma without memory windows), ``peer_id``, the name the writer declared, must be
        the job's writer (its PrefillStarted) once that is known."""
        if res.window is None:
            return True  # no remote writer to tell apart (a table used without windows)
        if keys is not None:
            return res.window.rkey in keys
        return not res.writer or peer_id == res.writer

    def _count_stray(
        self, slot: int, chunk: int, peer_id: str, why: str, res: Reservation | None
    ) -> None:
        self.num_stray_immediates += 1
        n = self.num_stray_immediates
        if logs.is_sampled(n):
            log.warning(
                "immediate refused",
                request_id=res.request_id if res is not None else None,
                slot=slot,
                chunk=chunk,
                peer=peer_id,
                reason=why,
                stray_immediates_total=n,
            )

    def on_started(self, request_id: str, lease_id: str, writer: str) -> bool:
        """A prefill worker took the job: it is the only one that may write these blocks."""
        res = self.get(request_id)
        if res is None or res.lease_id != lease_id or res.writer:
            return False
        res.writer = writer
        return True

    def on_writer_gone(self, writer: str) -> list[Verdict]:
        """The registry dropped prefill worker ``writer``: no write of it can land any more, so
        its reservations without a PrefillDone fail now and their blocks return at once (no
        quarantine: a dead process writes nothing). The client is not told from here: the
        router hears the same WorkerGone and runs the request again (or fails it itself); a
        final event from us would race with that and fail a request the router can save."""
        verdicts = []
        for res in [r for r in self.leases() if r.writer == writer]:
            if res.done is not None:
                continue  # it finished; the verdict waits only for writes already counted
            self._pop(res)
            verdicts.append(Verdict(res, False, f"prefill worker {writer} died", notify=False))
        return verdicts

    def abort(self, request_id: str, job_withdrawn: bool = False) -> Verdict | None:
        """The client went away. The blocks stay reserved until the prefill has stopped writing
        (its PrefillDone, which it sends on the same Abort) or the lease expires, so no late
        write lands in a block that was handed to another request. ``job_withdrawn``: the job
        was taken off the queue before any worker took it; if no writer showed up either, no
        write can ever come and the blocks are free now."""
        res = self.get(request_id)
        if res is None:
            return None
        res.is_aborted = True
        if job_withdrawn and not res.writer and not res.writes and res.done is None:
            self._pop(res)
            return Verdict(res, False, "aborted", notify=False)
        return self._settle(res)
