"""When each request of an open-loop benchmark is sent: arrival processes and trace replay (pure).

Arrival times are offsets in seconds from the start of a run; the first request goes at 0 and the
gaps between requests are drawn from the process, as ``vllm bench serve`` draws them:

- ``poisson``: exponential gaps with mean 1/rate;
- ``gamma``: gaps ~ Gamma(shape=burstiness, scale=1/(rate*burstiness)), mean 1/rate and
  coefficient of variation 1/sqrt(burstiness) (burstiness < 1: burstier than Poisson, > 1: more
  even; 1 is Poisson);
- ``constant``: gaps of exactly 1/rate.

A rate of ``inf`` sends every request at 0. A trace (JSONL, one ``{"timestamp": s, "input_len": n,
"output_len": n}`` per line) replays its own timestamps, shifted so the earliest is 0.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvmesh.shared.config.json_object import json_object

ArrivalKind = Literal["poisson", "gamma", "constant"]
ARRIVAL_KINDS: tuple[ArrivalKind, ...] = ("poisson", "gamma", "constant")


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the line."""


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    """An open-loop arrival process: ``rate`` requests per second on average (``inf``: all at 0)."""

    kind: ArrivalKind
    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival kind must be one of {', '.join(ARRIVAL_KINDS)}")
        if not self.rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.kind != "gamma" and self.burstiness != 1.0:
            raise ValueError(f"burstiness applies to gamma arrivals only, not {self.kind}")

    def gap(self, rng: random.Random) -> float:
        """One inter-arrival time in seconds."""
        if math.isinf(self.rate):
            return 0.0
        if self.kind == "poisson":
            return rng.expovariate(self.rate)
        if self.kind == "gamma":
            return rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))
        return 1.0 / self.rate


def arrival_times(process: ArrivalProcess, num_requests: int, rng: random.Random) -> list[float]:
    """``num_requests`` non-decreasing offsets in seconds, the first at 0."""
    assert num_requests >= 0
    times: list[float] = []
    now = 0.0
    for i in range(num_requests):
        if i:
            now += process.gap(rng)
        times.append(now)
    return times


def parse_rates(text: str) -> tuple[float, ...]:
    """``"1,2.5,inf"`` -> (1.0, 2.5, inf): the request rates of a sweep, in the order given."""
    rates = []
    for part in text.split(","):
        try:
            rate = float(part.strip())
        except ValueError:
            raise ValueError(f"request rate {part.strip()!r} is not a number (or inf)") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"request rate must be > 0 (or inf), got {part.strip()!r}")
        rates.append(rate)
    return tuple(rates)


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp: float  # seconds, any origin
    input_len: int
    output_len: int


def parse_trace(lines: Iterable[str], source: str = "<trace>") -> list[TraceRecord]:
    """The records of a JSONL trace, in file order; blank lines are skipped."""
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        row = json_object(line, where, TraceError)
        missing = [k for k in ("timestamp", "input_len", "output_len") if k not in row]
        if missing:
            raise TraceError(f"{where}: missing {', '.join(missing)}")
        timestamp = row["timestamp"]
        if isinstance(timestamp, bool) or not isinstance(timestamp, int | float):
            raise TraceError(f"{where}: timestamp must be a number, got {timestamp!r}")
        if not math.isfinite(timestamp):
            raise TraceError(f"{where}: timestamp must be finite, got {timestamp!r}")
        for key in ("input_len", "output_len"):
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TraceError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        records.append(TraceRecord(float(timestamp), row["input_len"], row["output_len"]))
    if not records:
        raise TraceError(f"{source}: the trace holds no records")
    return records


def load_trace(path: str | Path) -> list[TraceRecord]:
    """``parse_trace`` of a file, sorted by timestamp (stable: ties keep file order)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror})") from None
    return sorted(parse_trace(text.splitlines(), str(path)), key=lambda r: r.timestamp)


def trace_arrival_times(records: Sequence[TraceRecord]) -> list[float]:
    """The records' timestamps shifted so the earliest is 0 (records sorted by timestamp)."""
    assert all(a.timestamp <= b.timestamp for a, b in itertools.pairwise(records))
    start = records[0].timestamp if records else 0.0
    return [r.timestamp - start for r in records]
