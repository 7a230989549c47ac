"""The requests a simulation serves: arrival time, prompt and output length (no token ids).

Synthetic workloads draw lengths and arrival gaps exactly as ``kvmesh bench serve`` does for the
same seed (``loadgen.workload.sample_lengths`` on ``Random(f"{seed}:prompts")``,
``loadgen.arrivals.arrival_times`` on ``Random(f"{seed}:arrivals")``), so a simulated run and a
benchmark run of the same flags see the same requests at the same times.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times, load_trace, trace_arrival_times
from kvmesh.loadgen.workload import LengthSampler, sample_lengths


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    input_len: int
    output_len: int


def synthetic(
    process: ArrivalProcess,
    num_requests: int,
    input_lens: LengthSampler,
    output_lens: LengthSampler,
    seed: int = 0,
) -> list[SimRequest]:
    lengths = sample_lengths(
        num_requests, input_lens, output_lens, random.Random(f"{seed}:prompts")
    )
    times = arrival_times(process, num_requests, random.Random(f"{seed}:arrivals"))
    return [SimRequest(t, n_in, n_out) for t, (n_in, n_out) in zip(times, lengths, strict=True)]


def from_trace(path: str | Path, num_requests: int | None = None) -> list[SimRequest]:
    """The records of a JSONL trace (``loadgen.arrivals`` format), the first ``num_requests``."""
    records = load_trace(path)[:num_requests]
    times = trace_arrival_times(records)
    return [SimRequest(t, r.input_len, r.output_len) for t, r in zip(times, records, strict=True)]
