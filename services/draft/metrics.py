"""Every metric a draft worker exports on ``--metrics-port``, in one registry.

Acceptance is what the decode workers report back with their next context (``DraftContext``
``num_verified`` / ``num_accepted``); the decode workers export the same from their side
(``kvmesh_decode_spec_*``).
"""

from __future__ import annotations

from kvmesh.shared.obs.metric_set import MetricSet, seconds_buckets

DRAFT_BUCKETS = seconds_buckets(0.0005, 2.5)


class DraftMetrics(MetricSet):
    """A draft worker's metrics, registered in ``self.registry`` (one per worker)."""

    def __init__(self) -> None:
        super().__init__("kvmesh_draft")
        self.sequences = self.gauge("sequences", "Sequences whose context this worker holds.")
        self.proposals = self.counter("proposals_total", "Draft trees sent to decode workers.")
        self.draft_seconds = self.histogram(
            "batch_seconds",
            "Time to draft one batch of sequences (the drafter's compute).",
            DRAFT_BUCKETS,
        )
        self.verified_tokens = self.counter(
            "verified_tokens_total",
            "Draft tokens on the paths decode workers verified (as they reported).",
        )
        self.accepted_tokens = self.counter(
            "accepted_tokens_total", "Draft tokens decode workers accepted (as they reported)."
        )
        self.prompt_tokens_received = self.counter(
            "prompt_tokens_received_total",
            "Prompt tokens whose draft KV a prefill worker wrote into this worker's pool (early "
            "exit and model), adopted into its prefix cache: never computed here.",
        )
        self.context_tokens_computed = self.counter(
            "context_tokens_computed_total",
            "Context tokens (prompt + output) the drafter computed itself: the tokens of its "
            "drafts' contexts that were not prefix-cache hits (model drafters).",
        )
        self.prompt_kv_refused = self.counter(
            "prompt_kv_refused_total",
            "Prompt-KV reservations refused, failed or expired (the drafter computes those).",
        )
        self.resyncs = self.counter(
            "context_resyncs_total",
            "Contexts asked for again (a delta for a sequence this worker did not hold).",
        )
