"""Requests whose KV a prefill worker is writing into this decode worker: the pending table.

A reservation holds decode blocks under a lease. Every KV write of its prefill lands with an
immediate ``(slot, chunk)`` (kvmesh.shared.imm), which counts only if it came from the holder of
the lease (the transport vouches for the keys a write came with); the prefill then announces
``PrefillDone(num_writes, first_token)``. Writes and the announcement race (the immediate
travels on the data plane, the announcement on NATS), so a reservation is *ready* once both are
in: the announcement said ok and exactly ``num_writes`` distinct chunks have been counted. It
*fails* when the prefill reports failure, a chunk arrives twice or past ``num_writes``, and it
*expires* when its lease deadline passes first. An expired reservation is reported to the client
at once but its blocks are *quarantined*: a prefill that is merely late may still be writing into
them, so they go back to the pool only once that prefill has said it stopped (its PrefillDone,
with every announced write landed) or after a further ``quarantine_s`` without word from it.
Pure and synchronous: the service feeds it events and acts on what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.shared import logs
from kvmesh.shared.protocol import PrefillDone
from kvmesh.shared.transport.base import MemoryWindow

if TYPE_CHECKING:  # the table stays torch-free; it only carries the parameters
    from kvmesh.shared.engine.sequence import SamplingParams


log = logs.get_logger(__name__)


class ReservationError(ValueError):
    """A reservation that cannot be recorded as asked (duplicate request id, busy slot)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What the engine needs to admit a reservation once its prefill is in: the prompt the prefill
    computed and the request's sampling parameters."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(slots=True, eq=False)
class Reservation:
    request_id: str
    lease_id: str
    slot: int
    block_ids: tuple[int, ...]
    deadline: float  # monotonic seconds
    admission: Admission | None = None  # None only for a table used bare (tests)
    chunks: set[int] = field(default_factory=set)  # chunk indices whose write completed
    done: PrefillDone | None = None
    is_aborted: bool = False  # the client went away; blocks wait for the prefill to stop writing
    is_expired: bool = (
        False  # lease ran out: client told, blocks quarantined until the prefill stops
    )
    writer: str = ""  # the prefill worker that took the job (its PrefillStarted), if known
    # The window its writer holds the key of (None: no remote writer, or a table used bare).
    window: MemoryWindow | None = None

    @property
    def rkey(self) -> int:
        return self.window.rkey if self.window is not None else 0

    @property
    def num_writes(self) -> int:
        return len(self.chunks)


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a reservation: ``ok`` -> admit it; otherwise fail it. ``release``: its
    blocks go back now (False while quarantined); ``notify``: the client still has to be told."""

    reservation: Reservation
    ok: bool
    error: str = ""
    release: bool = True
    notify: bool = True


class PendingTable:
    """request id -> Reservation, plus slot -> request id for the immediates."""

    def __init__(self, quarantine_s: float = 30.0) -> None:
        self.quarantine_s = quarantine_s
        self._by_request: dict[str, Reservation] = {}
        self._by_slot: dict[int, str] = {}
        self.num_stray_immediates = 0  # late, or not from the lease holder's connection
        self.num_forged_announcements = 0  # PrefillDones without the lease's window key

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def get(self, request_id: str) -> Reservation | None:
        return self._by_request.get(request_id)

    def reservations(self) -> list[Reservation]:
        return list(self._by_request.values())

    def renew(self, request_id: str, lease_id: str, deadline: float) -> bool:
        """The holder of a live lease says it still wants the blocks: the deadline moves to
        ``deadline`` (never earlier). False for an unknown, expired or foreign lease."""
        res = self._by_request.get(request_id)
        if res is None or res.lease_id != lease_id or res.is_expired or res.is_aborted:
            return False
        res.deadline = max(res.deadline, deadline)
        return True

    def add(
        self,
        request_id: str,
        lease_id: str,
        slot: int,
        block_ids: tuple[int, ...],
        deadline: float,
        admission: Admission | None = None,
        window: MemoryWindow | None = None,
    ) -> Reservation:
        if request_id in self._by_request:
            raise ReservationError(f"request {request_id!r} already holds a reservation here")
        if slot in self._by_slot:
            raise ReservationError(
                f"imm slot {slot} is held by request {self._by_slot[slot]!r}; "
                "the KV pool has more blocks than immediates can tell apart"
            )
        res = Reservation(
            request_id, lease_id, slot, tuple(block_ids), deadline, admission, window=window
        )
        self._by_request[request_id] = res
        self._by_slot[slot] = request_id
        return res

    def _pop(self, res: Reservation) -> None:
        del self._by_request[res.request_id]
        del self._by_slot[res.slot]

    def _settle(self, res: Reservation) -> Verdict | None:
        """The verdict on ``res`` if one can be given now; pops it from the table then."""
        done = res.done
        if done is None:
            return None
        if res.is_expired:  # the client was told; free once every announced write has landed
            if done.ok and res.num_writes < done.num_writes:
                return None
            self._pop(res)
            return Verdict(res, False, "lease expired", notify=False)
        if res.num_writes > done.num_writes:
            verdict = Verdict(
                res,
                False,
                f"prefill announced {done.num_writes} KV writes but {res.num_writes} arrived",
            )
        elif not done.ok:
            verdict = Verdict(res, False, done.error or "prefill failed without a reason")
        elif done.num_writes < 1:
            verdict = Verdict(res, False, "prefill announced success without any KV write")
        elif res.num_writes < done.num_writes:
            return None  # writes still in flight on the data plane
        elif res.is_aborted:
            verdict = Verdict(res, False, "aborted")
        elif done.first_token < 0:
            verdict = Verdict(res, False, "prefill reported success without a first token")
        else:
            verdict = Verdict(res, True)
        self._pop(res)
        return verdict

    def on_immediate(
        self, slot: int, chunk: int, keys: frozenset[int] | None = None, peer_id: str = ""
    ) -> Verdict | None:
        """One KV write of chunk ``chunk`` landed for the reservation in ``slot``. It counts only
        if it came from the holder of that reservation's lease: ``keys`` are the keys the
        transport vouches the write came with (``Completion.keys``), and must hold the
        reservation's window key; where the transport cannot tell (None), ``peer_id``, the name
        the writer declared, must be the job's writer (its PrefillStarted) once that is known.
        Any other immediate is stray: counted and logged, and the reservation is untouched."""
        request_id = self._by_slot.get(slot)
        res = self._by_request[request_id] if request_id is not None else None
        if res is None:
            self._count_stray(slot, chunk, peer_id, "it names no live reservation (late or forged)")
            return None
        if not _from_lease_holder(res, keys, peer_id):
            self._count_stray(
                slot, chunk, peer_id, "it did not come from the holder of the lease", res
            )
            return None
        if chunk in res.chunks:
            self._pop(res)
            return Verdict(res, False, f"KV write for chunk {chunk} arrived twice")
        res.chunks.add(chunk)
        return self._settle(res)

    def _count_stray(
        self, slot: int, chunk: int, peer_id: str, why: str, res: Reservation | None = None
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

    def on_done(self, done: PrefillDone) -> Verdict | None:
        """The prefill's announcement; ignored unless it names a live reservation and lease, and
        carries the lease's window key (which only the job's holder knows)."""
        res = self._by_request.get(done.request_id)
        if res is None or res.lease_id != done.lease_id or res.done is not None:
            return None
        if res.window is not None and done.rkey != res.rkey:
            self.num_forged_announcements += 1
            return None
        res.done = done
        return self._settle(res)

    def on_started(self, request_id: str, lease_id: str, writer: str) -> bool:
        """A prefill worker took the job: it is the only one that may write these blocks."""
        res = self._by_request.get(request_id)
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
        for res in [r for r in self._by_request.values() if r.writer == writer]:
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
        res = self._by_request.get(request_id)
        if res is None:
            return None
        res.is_aborted = True
        if job_withdrawn and not res.writer and not res.chunks and res.done is None:
            self._pop(res)
            return Verdict(res, False, "aborted", notify=False)
        return self._settle(res)

    def expire(self, now: float) -> list[Verdict]:
        """Reservations whose lease (or quarantine) ran out before their prefill completed."""
        verdicts = []
        for res in [r for r in self._by_request.values() if r.deadline <= now]:
            if res.is_expired or res.done is not None:
                # Quarantine over (the prefill is gone), or the prefill already said it stopped.
                self._pop(res)
                verdicts.append(
                    Verdict(res, False, self._expiry_error(res), notify=not res.is_expired)
                )
            else:
                res.is_expired = True
                res.deadline = now + self.quarantine_s
                verdicts.append(Verdict(res, False, self._expiry_error(res), release=False))
        return verdicts

    @staticmethod
    def _expiry_error(res: Reservation) -> str:
        if res.is_aborted:
            return "aborted"
        return (
            f"prefill did not complete before the lease ran out "
            f"({res.num_writes} KV writes arrived, "
            f"{'PrefillDone received' if res.done else 'no PrefillDone'})"
        )

    def next_deadline(self) -> float | None:
        return min((r.deadline for r in self._by_request.values()), default=None)

    def num_reserved_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self._by_request.values())


def _from_lease_holder(res: Reservation, keys: frozenset[int] | None, peer_id: str) -> bool:
    """Whether an immediate for ``res`` came from the holder of its lease (see on_immediate)."""
    if res.window is None:
        return True  # no remote writer to tell apart (a table used without windows)
    if keys is not None:
        return res.window.rkey in keys
    # The transport cannot tell (rdma without memory windows): only declared names are left.
    return not res.writer or peer_id == res.writer
