"""Router metrics in the Prometheus text exposition format (pure, no I/O).

``RouterMetrics`` holds the histograms and counters; ``RequestTimer`` turns one request's events
(arrival, token batches, the prefill report, the end) into observations, from timestamps it is
given so tests can drive it with a fake clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.shared.protocol import DecodeAdvert, PrefillReport

LATENCY_BUCKETS = (
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


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(labels: Sequence[tuple[str, str]]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


@dataclass(slots=True)
class Histogram:
    """A cumulative-bucket histogram without labels."""

    name: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(init=False)
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.buckets) == sorted(self.buckets), self.buckets
        self.counts = [0] * len(self.buckets)  # non-cumulative; summed when rendered

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)  # upper bounds are inclusive (le)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.total += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_format_value(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_format_value(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


@dataclass(slots=True)
class Counter:
    """A counter with a fixed tuple of label names."""

    name: str
    help: str
    label_names: tuple[str, ...] = ()
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        assert len(label_values) == len(self.label_names), (self.name, label_values)
        assert amount >= 0, amount
        self.values[label_values] = self.values.get(label_values, 0.0) + amount

    def get(self, *label_values: str) -> float:
        return self.values.get(label_values, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for key in sorted(self.values):
            labels = _format_labels(list(zip(self.label_names, key, strict=True)))
            lines.append(f"{self.name}{labels} {_format_value(self.values[key])}")
        return lines


@dataclass(slots=True)
class Gauge:
    name: str
    help: str
    value: float = 0.0

    def render(self) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name} {_format_value(self.value)}",
        ]


@dataclass(slots=True)
class MirroredCounter:
    """A counter another process keeps, exported as its latest reported value per worker (a
    worker that restarts starts again from 0, which Prometheus reads as a counter reset)."""

    name: str
    help: str
    values: dict[str, float] = field(default_factory=dict)  # worker id -> value

    def set(self, worker_id: str, value: float) -> None:
        self.values[worker_id] = value

    def forget(self, worker_id: str) -> None:
        self.values.pop(worker_id, None)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for worker_id in sorted(self.values):
            labels = _format_labels([("worker", worker_id)])
            lines.append(f"{self.name}{labels} {_format_value(self.values[worker_id])}")
        return lines


class RouterMetrics:
    """Every metric the router exports; ``render()`` is the body of ``GET /metrics``."""

    def __init__(self, prefix: str = "kvmesh_router") -> None:
        def hist(name: str, help: str) -> Histogram:
            return Histogram(f"{prefix}_{name}", help)

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
        self.requests = Counter(
            f"{prefix}_requests_total",
            "Finished HTTP requests by endpoint and status code.",
            ("endpoint", "status"),
        )
        self.finish_reasons = Counter(
            f"{prefix}_finish_reason_total",
            "Finished generations by finish reason.",
            ("reason",),
        )
        self.prompt_tokens = Counter(f"{prefix}_prompt_tokens_total", "Prompt tokens processed.")
        self.generation_tokens = Counter(
            f"{prefix}_generation_tokens_total", "Output tokens generated."
        )
        self.aborts = Counter(
            f"{prefix}_aborts_total", "Abort messages published, by reason.", ("reason",)
        )
        self.retries = Counter(
            f"{prefix}_retries_total",
            "Requests run again because a worker died: by its role before the first token, "
            "decode-migrate for streams moved to another decode worker after it.",
            ("role",),
        )
        self.in_flight = Gauge(f"{prefix}_requests_in_flight", "Requests being served now.")
        self.waiting = Gauge(
            f"{prefix}_requests_waiting",
            "Accepted requests waiting in the admission queue for the mesh to have room.",
        )
        # What each decode worker refused (from its adverts): probing shows here.
        self.refused_accesses = MirroredCounter(
            "kvmesh_decode_refused_accesses_total",
            "One-sided writes and reads a decode worker's transport refused (key, bounds, a "
            "closed lease window, a dead key on a write notice).",
        )
        self.stray_immediates = MirroredCounter(
            "kvmesh_decode_stray_immediates_total",
            "Immediates that named no live reservation, or came with another lease's key.",
        )
        self.forged_announcements = MirroredCounter(
            "kvmesh_decode_forged_announcements_total",
            "PrefillDone messages without their lease's window key (ignored).",
        )

    def record_advert(self, advert: DecodeAdvert) -> None:
        self.refused_accesses.set(advert.worker_id, advert.refused_accesses)
        self.stray_immediates.set(advert.worker_id, advert.stray_immediates)
        self.forged_announcements.set(advert.worker_id, advert.forged_announcements)

    def forget_worker(self, worker_id: str) -> None:
        for metric in (self.refused_accesses, self.stray_immediates, self.forged_announcements):
            metric.forget(worker_id)

    def record_prefill(self, report: PrefillReport) -> None:
        self.queue.observe(report.queue_s)
        self.prefill_compute.observe(report.compute_s)
        self.kv_transfer.observe(report.transfer_s)
        self.exposed_transfer.observe(report.exposed_transfer_s)

    def render(self) -> str:
        lines: list[str] = []
        for metric in (
            self.ttft,
            self.itl,
            self.e2e,
            self.place,
            self.queue,
            self.prefill_compute,
            self.kv_transfer,
            self.exposed_transfer,
            self.requests,
            self.finish_reasons,
            self.prompt_tokens,
            self.generation_tokens,
            self.aborts,
            self.retries,
            self.in_flight,
            self.waiting,
            self.refused_accesses,
            self.stray_immediates,
            self.forged_announcements,
        ):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


@dataclass(slots=True)
class RequestTimer:
    """Timings of one generation, observed into ``metrics`` as they happen."""

    metrics: RouterMetrics
    arrived_at: float
    first_token_at: float | None = None
    last_token_at: float | None = None

    def on_tokens(self, now: float, num_tokens: int) -> None:
        """``num_tokens`` arrived together at ``now``; the gap is spread evenly over them."""
        if num_tokens <= 0:
            return
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
        if self.last_token_at is not None:
            self.metrics.e2e.observe(self.last_token_at - self.arrived_at)
        self.metrics.finish_reasons.inc(finish_reason)
        self.metrics.prompt_tokens.inc(amount=num_prompt_tokens)
        self.metrics.generation_tokens.inc(amount=num_output_tokens)
