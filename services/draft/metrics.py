"""Every metric a draft worker exports on ``--metrics-port``, in one registry.

Acceptance is what the decode workers report back with their next context (``DraftContext``
``num_verified`` / ``num_accepted``); the decode workers export the same from their side
(``kvmesh_decode_spec_*``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

DRAFT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DraftMetrics:
    """A draft worker's metrics, registered in ``self.registry`` (one per worker)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.sequences = Gauge(
            "kvmesh_draft_sequences", "Sequences whose context this worker holds.", registry=r
        )
        self.proposals = Counter(
            "kvmesh_draft_proposals_total", "Draft trees sent to decode workers.", registry=r
        )
        self.draft_seconds = Histogram(
            "kvmesh_draft_batch_seconds",
            "Time to draft one batch of sequences (the drafter's compute).",
            buckets=DRAFT_BUCKETS,
            registry=r,
        )
        self.verified_tokens = Counter(
            "kvmesh_draft_verified_tokens_total",
            "Draft tokens on the paths decode workers verified (as they reported).",
            registry=r,
        )
        self.accepted_tokens = Counter(
            "kvmesh_draft_accepted_tokens_total",
            "Draft tokens decode workers accepted (as they reported).",
            registry=r,
        )
        self.resyncs = Counter(
            "kvmesh_draft_context_resyncs_total",
            "Contexts asked for again (a delta for a sequence this worker did not hold).",
            registry=r,
        )
