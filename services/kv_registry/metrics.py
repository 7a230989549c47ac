"""Every metric the kv-registry exports on ``--metrics-port``, in one registry.

Placements and refusals are counted as the service answers (``observe_place``); leases and
workers are read from the registry's core when Prometheus scrapes (``CoreCollector``), so they
are exact without a call at every place the core changes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from kvmesh.shared.obs.metric_set import MetricSet, seconds_buckets
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvmesh.services.kv_registry.core import RegistryState

PLACE_BUCKETS = seconds_buckets(0.0005, 5.0)

ROLES = ("kv-registry", "router", "prefill", "decode", "colocated")

# Refusal reasons (the ``reason`` label): core.Refusal's, then the service's own.
REFUSAL_REASONS = (
    "no_workers",  # no live decode worker registered
    "draining",  # every fitting worker is draining
    "mismatch",  # no worker serves the model/layout/mode, or the prompt exceeds every pool
    "full",  # every fitting worker is out of free KV blocks right now
    "reserve_failed",  # the chosen workers refused the reservation or did not answer
    "worker_gone",  # the worker was dropped while its reservation was in flight
    "malformed",  # the place request did not decode
)


class CoreCollector(Collector):
    """Lease outcomes and live workers, read from ``core`` at scrape time."""

    def __init__(self, core: RegistryState) -> None:
        self.core = core

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = self.core.counters
        leases = CounterMetricFamily(
            "kvmesh_registry_leases",
            "Leases on decode blocks by outcome: granted (a remote prefill may write), "
            "completed (its PrefillDone came), expired (no renewal in time), dropped (its decode "
            "worker died).",
            labels=("outcome",),
        )
        for outcome in ("granted", "completed", "expired", "dropped"):
            leases.add_metric((outcome,), getattr(counters, outcome))
        yield leases
        yield GaugeMetricFamily(
            "kvmesh_registry_leases_active",
            "Leases granted and not yet over.",
            len(self.core.leases),
        )
        workers = GaugeMetricFamily(
            "kvmesh_registry_workers",
            "Workers the registry knows (heard within their timeout), by role.",
            labels=("role",),
        )
        by_role = dict.fromkeys(ROLES, 0)  # every role, 0 included: a pool that died shows
        for w in self.core.decode.values():
            by_role[w.role] = by_role.get(w.role, 0) + 1
        for p in self.core.peers.values():
            by_role[p.heartbeat.role] = by_role.get(p.heartbeat.role, 0) + 1
        for role, count in by_role.items():
            workers.add_metric((role,), count)
        yield workers
        yield GaugeMetricFamily(
            "kvmesh_registry_prefix_index_blocks",
            "Prefix block hashes in the registry's index (distinct, over every decode worker).",
            len(self.core.prefix_index),
        )
        yield CounterMetricFamily(
            "kvmesh_registry_kv_event_gaps",
            "Decode workers' KV event streams found to have missed messages (each waits for "
            "the worker's next digest to be in sync again).",
            self.core.prefix_index.num_gaps,
        )


class RegistryMetrics(MetricSet):
    """The kv-registry's metrics, registered in ``self.registry`` (one per registry)."""

    def __init__(self, core: RegistryState) -> None:
        super().__init__("kvmesh_registry")
        self.placements = self.counter(
            "placements_total",
            "Requests placed on a decode worker, by where their prompt is prefilled.",
            ("prefill",),
        )
        self.refusals = self.counter(
            "refusals_total",
            "Place requests refused, by reason: " + ", ".join(REFUSAL_REASONS) + ".",
            ("reason",),
        )
        self.place_seconds = self.histogram(
            "place_seconds",
            "Time to answer a place request (choosing, reserving on decode workers).",
            PLACE_BUCKETS,
        )
        self.prefix_hits = self.counter(
            "prefix_hit_placements_total",
            "Requests placed on a decode worker whose prefix cache held at least one leading "
            "block of their prompt (cache-hit placements).",
        )
        self.prefix_matched_tokens = self.counter(
            "prefix_matched_tokens_total",
            "Prompt tokens of placed requests found cached on the worker they were placed on.",
        )
        self.store_matched_tokens = self.counter(
            "store_matched_tokens_total",
            "Prompt tokens of placed requests whose blocks the kv-store their decode worker reads "
            "held (the leading run, as the stores' KV events said) when they were placed.",
        )
        self.store_read_placements = self.counter(
            "store_read_placements_total",
            "Requests placed on a decode worker expected to read leading blocks of their prompt "
            "from the kv-store it reads, past those it caches (it then prefills the rest itself).",
        )
        self.core = CoreCollector(core)
        self.registry.register(self.core)

    def observe_place(
        self, seconds: float, *, local_prefill: bool, refusal: str = "", cached_tokens: int = 0
    ) -> None:
        """A place request was answered: placed (``cached_tokens`` of its prompt cached where it
        went), or refused for reason ``refusal``."""
        assert not refusal or refusal in REFUSAL_REASONS, refusal
        self.place_seconds.observe(seconds)
        if refusal:
            self.refusals.labels(refusal).inc()
        else:
            self.placements.labels("local" if local_prefill else "remote").inc()
            if cached_tokens > 0:
                self.prefix_hits.inc()
                self.prefix_matched_tokens.inc(cached_tokens)
