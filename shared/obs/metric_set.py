"""Declaring a service's Prometheus metrics: one registry per service, names under one prefix.

Each service's ``metrics.py`` subclasses ``MetricSet`` and declares its metrics in ``__init__``
(``self.gauge("requests_running", ...)`` registers ``kvmesh_decode_requests_running``), so the
registry, the prefix and the keyword plumbing of prometheus_client are written once. Latency
histograms cut their buckets from one ladder (``seconds_buckets``), so every service's timings
can be compared bucket for bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 0.5 ms to 2 min: 1-2.5-5 per decade up to 10 s, then 30 s, 60 s, 120 s for long prefills
SECONDS_LADDER = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


def seconds_buckets(lo: float, hi: float) -> tuple[float, ...]:
    """The ladder's bounds from ``lo`` to ``hi``, both included (both must be on the ladder)."""
    assert lo in SECONDS_LADDER and hi in SECONDS_LADDER and lo <= hi, (lo, hi)
    return tuple(b for b in SECONDS_LADDER if lo <= b <= hi)


class MetricSet:
    """A registry of its own (``self.registry``) and constructors that name under ``prefix``."""

    def __init__(self, prefix: str) -> None:
        self.registry = CollectorRegistry()
        self.prefix = prefix
        # every service's: what its MessageGuard refused (shared/bus/message_guard.py)
        self.nats_refused = self.counter(
            "nats_refused_total",
            "NATS messages refused unhandled: oversized, malformed (not the subject's message "
            "type), no_reply (a request that cannot be answered), bad_reply (a request whose "
            "reply subject is no inbox), failed (its handler raised).",
            ("reason",),
        )

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        """``name`` ends in ``_total`` as queried (prometheus_client adds it when it does not)."""
        return Counter(f"{self.prefix}_{name}", help, labels, registry=self.registry)

    def gauge(self, name: str, help: str) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", help, registry=self.registry)

    def histogram(self, name: str, help: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", help, buckets=buckets, registry=self.registry)
