"""Every metric the router exports (``GET /metrics`` on its API port), in one registry.

``RouterMetrics`` holds the prometheus_client histograms, counters and gauges; ``RequestTimer``
turns one request's events (arrival, token batches, the end) into observations, from timestamps
it is given so tests can drive it with a fake clock. The refusal counters each decode worker
reports in its adverts are mirrored here per worker (``WorkerCounters``): they are the decode
worker's own counters, exported where every advert is heard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.services.router.timings import TimingLog, TimingStamps
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport
from kvmesh.shared.bus.messages.workers import DecodeAdvert
from kvmesh.shared.obs.metric_set import MetricSet, seconds_buckets
from kvmesh.shared.obs.metrics_exporter import exposition
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = seconds_buckets(0.001, 120.0)

# DecodeAdvert field -> (metric name, help)
ADVERTISED_COUNTERS = {
    "refused_accesses": (
        "kvmesh_decode_refused_accesses",
        "One-sided writes and reads a decode worker's transport refused (key, bounds, a closed "
        "lease window, a dead key on a write notice).",
    ),
    "stray_immediates": (
        "kvmesh_decode_stray_immediates",
        "Immediates that named no live reservation, or came with another lease's key.",
    ),
    "forged_announcements": (
        "kvmesh_decode_forged_announcements",
        "PrefillDone messages without their lease's window key (ignored).",
    ),
}


class WorkerCounters(Collector):
    """Counters other processes keep, exported as their latest reported value per worker (a
    worker that restarts starts again from 0, which Prometheus reads as a counter reset)."""

    def __init__(self) -> None:
        self.values: dict[str, dict[str, float]] = {}  # DataPlaneRefusals field -> worker id

    def record(self, advert: DecodeAdvert) -> None:
        for field in ADVERTISED_COUNTERS:
            self.values.setdefault(field, {})[advert.worker_id] = getattr(advert.refusals, field)

    def forget(self, worker_id: str) -> None:
        for by_worker in self.values.values():
            by_worker.pop(worker_id, None)

    def declared_labels(self) -> dict[str, tuple[str, ...]]:
        return {name: ("worker",) for name, _ in ADVERTISED_COUNTERS.values()}

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field, (name, help) in ADVERTISED_COUNTERS.items():
            family = CounterMetricFamily(name, help, labels=("worker",))
            for worker_id, value in sorted(self.values.get(field, {}).items()):
                family.add_metric((worker_id,), value)
            yield family


class RouterMetrics(MetricSet):
    """The router's metrics, registered in ``self.registry`` (one per router)."""

    def __init__(self, prefix: str = "kvmesh_router") -> None:
        super().__init__(prefix)

        def hist(name: str, help: str) -> Histogram:
            return self.histogram(name, help, LATENCY_BUCKETS)

        self.ttft = hist("time_to_first_token_seconds", "Request arrival to first output token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = hist("e2e_request_latency_seconds", "Request arrival to last output token.")
        self.place = hist(
            "place_seconds",
            "Arrival to placement: admission-queue wait while the mesh is full, plus placing.",
        )
        self.queue = hist("prefill_queue_seconds", "Time a prefill job waited for a worker.")
        self.prefill_compute = hist("prefill_compute_seconds", "Prefill compute time.")
        self.kv_transfer = hist("kv_transfer_seconds", "Total KV transfer time of a prefill.")
        self.exposed_transfer = hist(
            "kv_exposed_transfer_seconds", "KV transfer time not hidden behind prefill compute."
        )
        self.requests = self.counter(
            "requests_total",
            "Finished HTTP generation requests by endpoint and status code (499: the client "
            "went away); errors are the non-2xx statuses.",
            ("endpoint", "status"),
        )
        self.finish_reasons = self.counter(
            "finish_reason_total", "Finished generations by finish reason.", ("reason",)
        )
        self.prompt_tokens = self.counter("prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = self.counter("generation_tokens_total", "Output tokens generated.")
        self.aborts = self.counter(
            "aborts_total", "Abort messages published, by reason.", ("reason",)
        )
        self.retries = self.counter(
            "retries_total",
            "Requests run again because a worker died: by its role before the first token, "
            "decode-migrate for streams moved to another decode worker after it.",
            ("role",),
        )
        self.client_cutoffs = self.counter(
            "client_cutoffs_total",
            "Streams cut off because their client did not read: by the limit it passed (send "
            "buffer full, write timeout); their requests were aborted.",
            ("limit",),
        )
        self.http_refused = self.counter(
            "http_refused_total",
            "HTTP connections closed and requests refused by the router's limits: "
            "too_many_connections (one client's cap), router_full (the global cap, every "
            "connection in a request), pushed_out (an idle connection closed to make room under "
            "the global cap), accept_failed (out of descriptors), header_timeout, body_timeout, "
            "body_too_large.",
            ("reason",),
        )
        self.in_flight = self.gauge("requests_in_flight", "Requests being served now.")
        self.waiting = self.gauge(
            "requests_waiting",
            "Accepted requests waiting in the admission queue for the mesh to have room.",
        )
        # What each decode worker refused (from its adverts): probing shows here.
        self.decode_workers = WorkerCounters()
        self.registry.register(self.decode_workers)

    def record_advert(self, advert: DecodeAdvert) -> None:
        self.decode_workers.record(advert)

    def forget_worker(self, worker_id: str) -> None:
        self.decode_workers.forget(worker_id)

    def record_prefill(self, report: PrefillReport) -> None:
        self.queue.observe(report.queue_s)
        self.prefill_compute.observe(report.compute_s)
        self.kv_transfer.observe(report.transfer_s)
        self.exposed_transfer.observe(report.exposed_transfer_s)

    def sample(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when it has none yet), e.g.
        ``sample("kvmesh_router_retries_total", role="decode")``."""
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def render(self) -> str:
        """The Prometheus text exposition of every metric."""
        return exposition(self.registry)[0].decode()


@dataclass(slots=True)
class RequestTimer:
    """Timings of one generation, observed into ``metrics`` as they happen; with a ``log``, its
    time to first token by stage goes there when it finishes (services/router/timings.py)."""

    metrics: RouterMetrics
    arrived_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    log: TimingLog | None = None
    request_id: str = ""
    tenant: str = ""  # tenants.Tenant.name: who may read its timing
    num_output_tokens: int = 0  # so far; the usage's count once finished (the access log's)
    stamps: TimingStamps = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.stamps = TimingStamps(self.arrived_at)

    def on_tokens(self, now: float, num_tokens: int) -> None:
        """``num_tokens`` arrived together at ``now``; the gap is spread evenly over them."""
        if num_tokens <= 0:
            return
        self.num_output_tokens += num_tokens
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrived_at)
            num_gaps, since = num_tokens - 1, now
        else:
            assert self.last_token_at is not None
            num_gaps, since = num_tokens, self.last_token_at
        if num_gaps:
            gap = (now - since) / num_gaps
            for _ in range(num_gaps):
                self.metrics.itl.observe(gap)
        self.last_token_at = now

    def on_finish(self, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.num_output_tokens = num_output_tokens
        if self.last_token_at is not None:
            self.metrics.e2e.observe(self.last_token_at - self.arrived_at)
        if self.log is not None and self.first_token_at is not None:
            timing = self.stamps.timing(self.request_id, self.first_token_at, num_prompt_tokens)
            if timing is not None:
                self.log.add(timing, self.tenant)
        self.metrics.finish_reasons.labels(finish_reason).inc()
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.generation_tokens.inc(num_output_tokens)
