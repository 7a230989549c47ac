"""Prompt-KV leases of an early-exit draft worker: blocks a prefill worker writes a prompt's
draft KV into (docs/speculative.md, Prompt KV through the data plane). Pure and synchronous.

A lease holds draft-pool blocks, one per full block of the prompt, under a write window. Every
write of the prefill lands with an immediate ``(slot, write index)`` (kvmesh.shared.imm), which
counts only if the transport vouches it came with the window's key; the prefill then announces
``PrefillDone(num_writes)`` on ``draft_kv_done``. Writes and the announcement race, so a lease
is *ready* once both are in: the announcement said ok and exactly ``num_writes`` distinct
writes were counted; then its blocks are adopted into the draft engine's prefix cache. It
*fails* on a failed announcement, a write counted twice or past ``num_writes``, and *expires*
when its deadline passes first. An expired lease whose window the transport enforces frees its
blocks at once (no late write can land once the window is closed); otherwise they are
quarantined until the prefill's announcement (with every announced write landed) or a further
``quarantine_s``. The shell feeds events and acts on the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.shared.protocol import PrefillDone
from kvmesh.shared.transport.base import MemoryWindow


class PromptKvError(ValueError):
    """A lease that cannot be recorded as asked (duplicate request id, busy slot)."""


@dataclass(slots=True, eq=False)
class PromptKvLease:
    request_id: str
    lease_id: str
    slot: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # the prompt's full blocks: what the blocks will hold
    deadline: float  # monotonic seconds
    window: MemoryWindow | None = None  # None: a table used bare (tests)
    writes: set[int] = field(default_factory=set)  # write indices that landed
    done: PrefillDone | None = None
    is_expired: bool = False

    @property
    def rkey(self) -> int:
        return self.window.rkey if self.window is not None else 0


@dataclass(frozen=True, slots=True)
class PromptKvVerdict:
    """``ok``: adopt the blocks (then free them: cached); else free them, unless ``release`` is
    False (quarantined: a late write may still land)."""

    lease: PromptKvLease
    ok: bool
    error: str = ""
    release: bool = True


class PromptKvTable:
    """request id -> lease, plus slot -> request id for the immediates."""

    def __init__(self, quarantine_s: float = 30.0) -> None:
        self.quarantine_s = quarantine_s
        self._by_request: dict[str, PromptKvLease] = {}
        self._by_slot: dict[int, str] = {}
        self.num_stray_immediates = 0  # late, or without the lease's window key

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_request

    def add(
        self,
        request_id: str,
        lease_id: str,
        slot: int,
        block_ids: tuple[int, ...],
        token_ids: tuple[int, ...],
        deadline: float,
        window: MemoryWindow | None = None,
    ) -> PromptKvLease:
        if request_id in self._by_request:
            raise PromptKvError(f"request {request_id!r} already holds a prompt-KV lease here")
        if slot in self._by_slot:
            raise PromptKvError(f"imm slot {slot} is held by request {self._by_slot[slot]!r}")
        lease = PromptKvLease(
            request_id, lease_id, slot, tuple(block_ids), tuple(token_ids), deadline, window
        )
        self._by_request[request_id] = lease
        self._by_slot[slot] = request_id
        return lease

    def _pop(self, lease: PromptKvLease) -> None:
        del self._by_request[lease.request_id]
        del self._by_slot[lease.slot]

    def _settle(self, lease: PromptKvLease) -> PromptKvVerdict | None:
        done = lease.done
        if done is None:
            return None
        num_writes = len(lease.writes)
        if lease.is_expired:  # quarantined: free once every announced write has landed
            if done.ok and num_writes < done.num_writes:
                return None
            self._pop(lease)
            return PromptKvVerdict(lease, False, "lease expired")
        if num_writes > done.num_writes:
            error = f"prefill announced {done.num_writes} writes but {num_writes} arrived"
        elif not done.ok:
            error = done.error or "prefill failed without a reason"
        elif done.num_writes < 1:
            error = "prefill announced success without any write"
        elif num_writes < done.num_writes:
            return None  # writes still in flight on the data plane
        else:
            error = ""
        self._pop(lease)
        return PromptKvVerdict(lease, not error, error)

    def on_immediate(
        self, slot: int, write: int, keys: frozenset[int] | None = None
    ) -> PromptKvVerdict | None:
        """Write ``write`` of the lease in ``slot`` landed. It counts only if the transport
        vouches it came with the lease's window key (``keys``; None: it cannot tell)."""
        request_id = self._by_slot.get(slot)
        lease = self._by_request[request_id] if request_id is not None else None
        if lease is None or (
            lease.window is not None and keys is not None and lease.rkey not in keys
        ):
            self.num_stray_immediates += 1
            return None
        if write in lease.writes:
            self._pop(lease)
            return PromptKvVerdict(lease, False, f"write {write} arrived twice")
        lease.writes.add(write)
        return self._settle(lease)

    def on_done(self, done: PrefillDone) -> PromptKvVerdict | None:
        """The prefill's announcement; ignored unless it names a live lease and carries its
        window key (which only the prefill that got the reply knows)."""
        lease = self._by_request.get(done.request_id)
        if lease is None or lease.lease_id != done.lease_id or lease.done is not None:
            return None
        if lease.window is not None and done.rkey != lease.rkey:
            return None
        lease.done = done
        return self._settle(lease)

    def expire(self, now: float) -> list[PromptKvVerdict]:
        """Leases (and quarantines) whose deadline passed before they were ready."""
        verdicts = []
        for lease in [x for x in self._by_request.values() if x.deadline <= now]:
            enforced = lease.window is None or lease.window.enforced
            if lease.is_expired or lease.done is not None or enforced:
                self._pop(lease)
                verdicts.append(PromptKvVerdict(lease, False, "lease expired"))
            else:
                lease.is_expired = True
                lease.deadline = now + self.quarantine_s
                verdicts.append(PromptKvVerdict(lease, False, "lease expired", release=False))
        return verdicts
