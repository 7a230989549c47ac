"""Write leases: blocks of a KV pool that one remote writer may fill, counted write by write.
Pure and synchronous; the table behind a decode worker's reservations
(kvmesh.services.decode.pending) and a draft worker's prompt-KV leases
(kvmesh.services.draft.prompt_kv).

A lease holds blocks under a write window. Every write of its holder lands with an immediate
``(slot, write index)`` (kvmesh.shared.kv.imm), which counts only if it came from the holder (the
transport vouches for the keys a write came with); the holder then announces
``PrefillDone(num_writes)``. Writes and the announcement race (the immediate travels on the
data plane, the announcement on NATS), so a lease is *ready* once both are in: the
announcement said ok and exactly ``num_writes`` distinct writes have been counted. It *fails*
on a failed announcement, a write counted twice or past ``num_writes``, and *expires* when its
deadline passes first. An expired lease's blocks are *quarantined* where a late write may still
land in them: they go back only once the writer said it stopped (its announcement, with every
announced write landed) or after a further ``quarantine_s`` without word from it.

``WriteLeaseTable`` keeps those rules; a subclass adds what its leases are for (hooks
``_ready_error``, ``_frees_at_expiry``, ``_expiry_error``, ``_from_holder``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast

from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.transport.base import MemoryWindow


class WriteLeaseError(ValueError):
    """A lease that cannot be recorded as asked (duplicate request id, busy slot)."""


@dataclass(slots=True, eq=False)
class WriteLease:
    request_id: str
    lease_id: str
    slot: int
    block_ids: tuple[int, ...]
    deadline: float  # monotonic seconds
    # The window its writer holds the key of (None: no remote writer, or a table used bare).
    window: MemoryWindow | None = None
    writes: set[int] = field(default_factory=set)  # write indices that landed
    done: PrefillDone | None = None
    is_expired: bool = False  # deadline passed first: quarantined until the writer stops

    @property
    def rkey(self) -> int:
        return self.window.rkey if self.window is not None else 0

    @property
    def num_writes(self) -> int:
        return len(self.writes)


L = TypeVar("L", bound=WriteLease)


@dataclass(frozen=True, slots=True)
class LeaseVerdict(Generic[L]):
    """What to do with a lease that left the table (or expired): ``ok`` -> use its blocks;
    otherwise fail it. ``release``: its blocks go back now (False while quarantined);
    ``notify``: whoever waits on it still has to be told."""

    lease: L
    ok: bool
    error: str = ""
    release: bool = True
    notify: bool = True


class WriteLeaseTable(Generic[L]):
    """request id -> lease, plus slot -> request id for the immediates."""

    error_type: type[WriteLeaseError] = WriteLeaseError
    noun = "a write lease"  # in error messages: "request 'r' already holds <noun> here"
    lease_type: type[WriteLease] = WriteLease  # what ``add`` records (a subclass: L)

    def __init__(self, quarantine_s: float = 30.0) -> None:
        self.quarantine_s = quarantine_s
        self._by_request: dict[str, L] = {}
        self._by_slot: dict[int, str] = {}
        self.num_stray_immediates = 0  # late, or not from the lease holder
        self.num_forged_announcements = 0  # announcements without the lease's window key

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def get(self, request_id: str) -> L | None:
        return self._by_request.get(request_id)

    def leases(self) -> list[L]:
        return list(self._by_request.values())

    def postpone(self, seconds: float) -> None:
        """The holders could not reach us for ``seconds`` (a NATS outage): no renewal could
        come, so every deadline moves that much later; a lease runs out only after a whole
        lease of silence heard with the connection up."""
        for lease in self._by_request.values():
            lease.deadline += seconds

    def next_deadline(self) -> float | None:
        return min((x.deadline for x in self._by_request.values()), default=None)

    def num_reserved_blocks(self) -> int:
        return sum(len(x.block_ids) for x in self._by_request.values())

    def add(
        self,
        request_id: str,
        lease_id: str,
        slot: int,
        block_ids: tuple[int, ...],
        deadline: float,
        window: MemoryWindow | None = None,
        **extra: Any,
    ) -> L:
        """Record a new lease of ``lease_type`` (``extra``: its own fields); refused with
        ``error_type`` when the request already holds one here or the slot is taken."""
        lease = self.lease_type(
            request_id, lease_id, slot, tuple(block_ids), deadline, window, **extra
        )
        return self._insert(cast(L, lease))

    def _insert(self, lease: L) -> L:
        if lease.request_id in self._by_request:
            raise self.error_type(f"request {lease.request_id!r} already holds {self.noun} here")
        if lease.slot in self._by_slot:
            raise self.error_type(
                f"imm slot {lease.slot} is held by request {self._by_slot[lease.slot]!r}; "
                "the KV pool has more blocks than immediates can tell apart"
            )
        self._by_request[lease.request_id] = lease
        self._by_slot[lease.slot] = lease.request_id
        return lease

    def _pop(self, lease: L) -> None:
        del self._by_request[lease.request_id]
        del self._by_slot[lease.slot]

    # -- hooks ----------------------------------------------------------------------------

    def _ready_error(self, lease: L) -> str:
        """Every announced write landed and the announcement said ok: why the lease still
        fails ("" when it is ready)."""
        return ""

    def _expiry_error(self, lease: L) -> str:
        return "lease expired"

    def _frees_at_expiry(self, lease: L) -> bool:
        """Whether an expired lease without an announcement frees its blocks at once (no late
        write can land) rather than being quarantined."""
        return False

    def _from_holder(self, lease: L, keys: frozenset[int] | None, peer_id: str) -> bool:
        """Whether an immediate for ``lease`` came from its holder: ``keys`` are the keys the
        transport vouches the write came with (None: it cannot tell)."""
        return lease.window is None or keys is None or lease.rkey in keys

    def _count_stray(self, slot: int, write: int, peer_id: str, why: str, lease: L | None) -> None:
        self.num_stray_immediates += 1

    # -- events ---------------------------------------------------------------------------

    def _settle(self, lease: L) -> LeaseVerdict[L] | None:
        """The verdict on ``lease`` if one can be given now; pops it from the table then."""
        done = lease.done
        if done is None:
            return None
        n = lease.num_writes
        if lease.is_expired:  # told already; free once every announced write has landed
            if done.ok and n < done.num_writes:
                return None
            self._pop(lease)
            return LeaseVerdict(lease, False, self._expiry_error(lease), notify=False)
        if n > done.num_writes:
            error = f"prefill announced {done.num_writes} KV writes but {n} arrived"
        elif not done.ok:
            error = done.error or "prefill failed without a reason"
        elif done.num_writes < 1:
            error = "prefill announced success without any KV write"
        elif n < done.num_writes:
            return None  # writes still in flight on the data plane
        else:
            error = self._ready_error(lease)
        self._pop(lease)
        return LeaseVerdict(lease, not error, error)

    def on_immediate(
        self, slot: int, write: int, keys: frozenset[int] | None = None, peer_id: str = ""
    ) -> LeaseVerdict[L] | None:
        """Write ``write`` of the lease in ``slot`` landed. It counts only if it came from the
        lease's holder (``_from_holder``); any other immediate is stray: counted, and the
        lease is untouched."""
        request_id = self._by_slot.get(slot)
        lease = self._by_request[request_id] if request_id is not None else None
        if lease is None:
            self._count_stray(slot, write, peer_id, "it names no live lease (late or forged)", None)
            return None
        if not self._from_holder(lease, keys, peer_id):
            self._count_stray(
                slot, write, peer_id, "it did not come from the lease's holder", lease
            )
            return None
        if write in lease.writes:
            self._pop(lease)
            return LeaseVerdict(lease, False, f"KV write {write} arrived twice")
        lease.writes.add(write)
        return self._settle(lease)

    def on_done(self, done: PrefillDone) -> LeaseVerdict[L] | None:
        """The writer's announcement; ignored unless it names a live lease and carries the
        lease's window key (which only the lease's holder knows)."""
        lease = self._by_request.get(done.request_id)
        if lease is None or lease.lease_id != done.lease_id or lease.done is not None:
            return None
        if lease.window is not None and done.rkey != lease.rkey:
            self.num_forged_announcements += 1
            return None
        lease.done = done
        return self._settle(lease)

    def expire(self, now: float) -> list[LeaseVerdict[L]]:
        """Leases whose deadline (or quarantine) ran out before they were ready."""
        verdicts = []
        for lease in [x for x in self._by_request.values() if x.deadline <= now]:
            error = self._expiry_error(lease)
            if lease.is_expired or lease.done is not None or self._frees_at_expiry(lease):
                # Quarantine over (the writer is gone), the writer said it stopped, or no
                # late write can land.
                self._pop(lease)
                verdicts.append(LeaseVerdict(lease, False, error, notify=not lease.is_expired))
            else:
                lease.is_expired = True
                lease.deadline = now + self.quarantine_s
                verdicts.append(LeaseVerdict(lease, False, error, release=False))
        return verdicts
