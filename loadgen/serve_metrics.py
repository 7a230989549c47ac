"""Per-request timings of a serving benchmark and the figures made from them (pure math, no I/O).

Definitions (as ``vllm bench serve`` has them; times in seconds since the run started):

- TTFT: first content chunk - send. E2E: end of stream - send.
- TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token.
- ITL: every gap between consecutive content chunks. A server that puts several tokens in one
  chunk shows fewer, longer gaps than its TPOT; a freeze shows as one long gap.
- Throughputs divide by the run's duration (first send to last end): completed requests, their
  output tokens, their input + output tokens.
- Goodput: completed requests per second that meet every SLO given. ``itl_ms`` is checked against
  the request's TPOT, vLLM's goodput definition (an average, so one freeze inside an otherwise fast
  stream can still pass it; the ITL percentiles and the gap plot show freezes). ``tpot_ms`` is the
  same check by its own name.
- Failures are counted by kind (``http_429``, ``timeout``, ``connection_error``, ``stream_error``,
  ``incomplete``, ...); a failed request adds to no latency or throughput figure.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What one request did. ``chunk_times``: arrival of every chunk that carried output."""

    index: int
    arrival_s: float  # when the arrival process scheduled it
    send_s: float  # when it went out (later than arrival_s when --max-concurrency held it)
    end_s: float
    prompt_len: int
    output_len: int  # tokens asked for
    num_output_tokens: int  # from the server's usage, else the number of content chunks
    chunk_times: tuple[float, ...] = ()
    error: str | None = None  # failure kind; None: completed
    detail: str = ""  # what went wrong, for a person
    response_id: str = ""  # the server's id of the request (its chunks' ``id``), when it said

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.send_s if self.chunk_times else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        ttft = self.ttft_s
        if ttft is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - ttft) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    assert values, "percentile of no values"
    assert 0 <= p <= 100
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Stats:
    """mean, median, p90, p99 and max of some latencies, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Stats | None:
        if not values:
            return None
        p50, p90, p99 = (percentile(values, p) * 1e3 for p in PERCENTILES)
        mean = math.fsum(values) / len(values) * 1e3
        return cls(len(values), mean, p50, p90, p99, max(values) * 1e3)


def parse_ms_limits(text: str, names: Mapping[str, str], what: str) -> dict[str, float]:
    """``"NAME=MS,NAME=MS"`` (any subset, blanks skipped) as {field: ms}; ``names`` maps each
    NAME it takes to its field (aliases map to the same one); errors name ``what`` (a flag)."""
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key.strip() not in names:
            raise ValueError(
                f"{what} {part!r}: expected NAME=MS with NAME one of {', '.join(names)}"
            )
        try:
            values[names[key.strip()]] = float(raw)
        except ValueError:
            raise ValueError(f"{what} {part!r}: {raw!r} is not a number of milliseconds") from None
    return values


@dataclass(frozen=True, slots=True)
class Slo:
    """Service-level objectives in milliseconds; None: not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None  # --slo itl_ms= sets this too (vLLM's goodput uses TPOT)
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0 ms, got {value}")

    @property
    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """``"ttft_ms=500,itl_ms=50,e2e_ms=10000"`` (any subset; ``tpot_ms`` = ``itl_ms``)."""
        names = {
            "ttft_ms": "ttft_ms",
            "itl_ms": "tpot_ms",
            "tpot_ms": "tpot_ms",
            "e2e_ms": "e2e_ms",
        }
        return cls(**parse_ms_limits(text, names, "SLO"))

    def is_met(self, record: RequestRecord) -> bool:
        """Completed and within every objective (TPOT counts as met with < 2 output tokens)."""
        if not record.is_ok:
            return False
        ttft, tpot = record.ttft_s, record.tpot_s
        checks = (
            (self.ttft_ms, ttft),
            (self.tpot_ms, tpot if tpot is not None else 0.0),
            (self.e2e_ms, record.e2e_s),
        )
        return all(
            limit is None or (value is not None and value * 1e3 <= limit) for limit, value in checks
        )


@dataclass(frozen=True, slots=True)
class Summary:
    """The figures of one run."""

    duration_s: float
    num_requests: int
    num_completed: int
    num_failed: int
    failures: dict[str, int]  # kind -> count
    num_short: int  # completed with fewer output tokens than asked
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    num_good: int | None  # None without an SLO
    goodput: float | None  # good requests / s
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    slo: Slo = field(default_factory=Slo)


def summarize(
    records: Iterable[RequestRecord], duration_s: float, slo: Slo | None = None
) -> Summary:
    records = list(records)
    assert duration_s > 0 or not records, "a run with requests lasts some time"
    slo = slo or Slo()
    done = [r for r in records if r.is_ok]
    failures = dict(sorted(Counter(r.error for r in records if r.error is not None).items()))
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    num_good = None if slo.is_empty else sum(slo.is_met(r) for r in done)
    return Summary(
        duration_s=duration_s,
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        failures=failures,
        num_short=sum(r.num_output_tokens < r.output_len for r in done),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=per_s(len(done)),
        output_throughput=per_s(output_tokens),
        total_token_throughput=per_s(input_tokens + output_tokens),
        num_good=num_good,
        goodput=None if num_good is None else per_s(num_good),
        ttft=Stats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Stats.of_seconds([r.tpot_s for r in done if r.tpot_s is not None]),
        itl=Stats.of_seconds([gap for r in done for gap in r.itl_s]),
        e2e=Stats.of_seconds([r.e2e_s for r in done]),
        slo=slo,
    )
