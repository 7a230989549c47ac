"""Arrival processes of ``kvmesh bench serve``: their statistics, trace replay, reproducibility."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
from kvmesh.loadgen.arrivals import (
    ArrivalProcess,
    TraceError,
    arrival_times,
    load_trace,
    parse_rates,
    parse_trace,
    trace_arrival_times,
)

NUM_SAMPLES = 20_000


def gaps(kind: str, rate: float, burstiness: float = 1.0, seed: int = 1) -> list[float]:
    times = arrival_times(ArrivalProcess(kind, rate, burstiness), NUM_SAMPLES, random.Random(seed))
    return [b - a for a, b in itertools.pairwise(times)]


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.fmean(values)


def test_poisson_mean_gap_is_one_over_rate_with_unit_cv():
    sample = gaps("poisson", rate=8.0)
    assert statistics.fmean(sample) == pytest.approx(1 / 8.0, rel=0.03)
    assert cv(sample) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_mean_gap_is_one_over_rate_and_cv_is_inverse_sqrt_burstiness(burstiness):
    sample = gaps("gamma", rate=5.0, burstiness=burstiness)
    assert statistics.fmean(sample) == pytest.approx(1 / 5.0, rel=0.05)
    assert cv(sample) == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_constant_arrivals_are_exactly_evenly_spaced():
    times = arrival_times(ArrivalProcess("constant", 4.0), 9, random.Random(0))
    assert times == [i * 0.25 for i in range(9)]


def test_infinite_rate_sends_everything_at_zero():
    for kind in ("poisson", "constant"):
        assert arrival_times(ArrivalProcess(kind, math.inf), 5, random.Random(0)) == [0.0] * 5


def test_arrivals_repeat_exactly_with_the_same_seed():
    process = ArrivalProcess("gamma", 3.0, 0.5)
    first = arrival_times(process, 200, random.Random("7:arrivals"))
    again = arrival_times(process, 200, random.Random("7:arrivals"))
    other = arrival_times(process, 200, random.Random("8:arrivals"))
    assert first == again
    assert first != other
    assert first[0] == 0.0 and first == sorted(first)


def test_arrival_process_rejects_bad_rate_and_misplaced_burstiness():
    with pytest.raises(ValueError, match="rate"):
        ArrivalProcess("poisson", 0.0)
    with pytest.raises(ValueError, match="burstiness applies to gamma"):
        ArrivalProcess("poisson", 1.0, burstiness=2.0)
    with pytest.raises(ValueError, match="positive"):
        ArrivalProcess("gamma", 1.0, burstiness=0.0)


def test_parse_rates_reads_a_sweep_with_inf():
    assert parse_rates("1, 2.5,inf") == (1.0, 2.5, math.inf)
    for bad in ("0", "-1", "fast", "nan"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_trace_replays_its_timestamps_from_zero_in_order(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(
        '{"timestamp": 100.5, "input_len": 10, "output_len": 3}\n'
        "\n"
        '{"timestamp": 100.0, "input_len": 20, "output_len": 4}\n'
        '{"timestamp": 102.25, "input_len": 30, "output_len": 5}\n'
    )
    records = load_trace(path)
    assert [(r.input_len, r.output_len) for r in records] == [(20, 4), (10, 3), (30, 5)]
    assert trace_arrival_times(records) == [0.0, 0.5, 2.25]


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "t:1: invalid JSON"),
        ('{"timestamp": 1, "input_len": 2}', "t:1: missing output_len"),
        ('{"timestamp": "x", "input_len": 2, "output_len": 2}', "timestamp must be a number"),
        ('{"timestamp": 1, "input_len": 0, "output_len": 2}', "input_len must be an integer >= 1"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_trace_rejects_bad_lines_by_line_number(line, message):
    with pytest.raises(TraceError, match=message):
        parse_trace([line], "t")


def test_trace_rejects_an_empty_file():
    with pytest.raises(TraceError, match="no records"):
        parse_trace(["", "  "], "t")
