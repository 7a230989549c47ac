"""Prompt-KV leases of a draft worker: blocks a prefill worker writes a prompt's draft KV into
(docs/speculative.md, Prompt KV through the data plane). Pure and synchronous.

A lease is a write lease (kvmesh.shared.mesh.write_lease: immediates ``(slot, write index)`` counted
only with the window's key, then ``PrefillDone(num_writes)`` on ``draft_kv_done``; ready once
both are in) on draft-pool blocks, one per full block of the prompt, plus the prompt tokens
those blocks will hold; a ready lease's blocks are adopted into the draft engine's prefix
cache. An expired lease whose window the transport enforces frees its blocks at once (no late
write can land once the window is closed); otherwise they are quarantined until the prefill's
announcement (with every announced write landed) or a further ``quarantine_s``. The shell feeds
events and acts on the verdicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.shared.mesh.write_lease import (
    LeaseVerdict,
    WriteLease,
    WriteLeaseError,
    WriteLeaseTable,
)


class PromptKvError(WriteLeaseError):
    """A lease that cannot be recorded as asked (duplicate request id, busy slot)."""


@dataclass(slots=True, eq=False)
class PromptKvLease(WriteLease):
    token_ids: tuple[int, ...] = ()  # the prompt's full blocks: what the blocks will hold


PromptKvVerdict = LeaseVerdict  # of a PromptKvLease: ``ok``: adopt the blocks, then free them


class PromptKvTable(WriteLeaseTable[PromptKvLease]):
    """request id -> lease, plus slot -> request id for the immediates."""

    error_type = PromptKvError
    noun = "a prompt-KV lease"
    lease_type = PromptKvLease  # add(..., token_ids=...)

    def _frees_at_expiry(self, lease: PromptKvLease) -> bool:
        return lease.window is None or lease.window.enforced
