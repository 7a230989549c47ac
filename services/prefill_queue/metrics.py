"""The prefill-queue keeper's metrics (``--metrics-port``)."""

from __future__ import annotations

from kvmesh.shared.obs.metric_set import MetricSet


class QueueKeeperMetrics(MetricSet):
    def __init__(self, prefix: str = "kvmesh_prefill_queue") -> None:
        super().__init__(prefix)
        self.depth = self.gauge("depth", "Prefill jobs waiting in the queue for a worker.")
        self.replicas = self.gauge("replicas", "Replicas the queue's stream has now.")
        self.problems = self.gauge(
            "problems",
            "Ways the queue differs from what kvmesh makes (missing, other subjects, a republish "
            "rule, a push consumer); 0 when it is as made.",
        )
        self.made = self.counter(
            "made_total",
            "Times the keeper made the queue's stream or consumer (only on a server without "
            "credentials; admin makes it elsewhere).",
            ("what",),
        )
