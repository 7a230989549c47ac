"""SLO attainment and goodput over a rate sweep (DistServe's measure): which requests attain,
the share per rate and scale, the highest rate at >= 90%, per core."""

from __future__ import annotations

import math

import orjson
import pytest
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.loadgen.slo_attainment import (
    SloObjective,
    attainment,
    format_sweep,
    goodput,
    parse_scales,
    sweep,
    sweep_json,
)

BASE = SloObjective(ttft_ms=1000, tpot_ms=50, gap_p99_ms=200)


def record(ttft: float, gaps: list[float], error: str | None = None) -> RequestRecord:
    """A request sent at 0 whose first token came at ``ttft`` s and the others ``gaps`` apart."""
    times = [ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    return RequestRecord(0, 0.0, 0.0, times[-1], 10, len(times), len(times), tuple(times), error)


def test_a_request_attains_only_within_every_limit():
    assert BASE.is_met(record(0.9, [0.04] * 50))
    assert not BASE.is_met(record(1.1, [0.04] * 50))  # TTFT
    assert not BASE.is_met(record(0.9, [0.06] * 50))  # TPOT
    # five 1 s freezes in 400 gaps: TPOT 42 ms passes, the p99 gap does not
    assert not BASE.is_met(record(0.9, [0.03] * 395 + [1.0] * 5))
    assert BASE.is_met(record(0.9, [0.03] * 395 + [0.15] * 5))
    assert not BASE.is_met(record(0.5, [0.01], error="timeout"))
    assert BASE.is_met(record(0.5, []))  # one token: no gap to judge


def test_scaling_multiplies_every_limit():
    tight = BASE.scaled(0.5)
    assert tight == SloObjective(500, 25, 100)
    slow_start = record(0.8, [0.02] * 10)
    assert BASE.is_met(slow_start) and not tight.is_met(slow_start)


def test_attainment_counts_failures_as_missed():
    records = [record(0.5, [0.01]), record(0.5, [0.01]), record(2.0, [0.01]), record(0.1, [], "x")]
    assert attainment(records, BASE) == 0.5
    assert attainment([], BASE) == 0.0


def test_goodput_is_the_highest_rate_before_the_first_miss():
    assert goodput([(0.2, 1.0), (0.4, 0.95), (0.8, 0.85), (1.6, 0.92)]) == 0.4
    assert goodput([(0.8, 0.9), (0.4, 1.0)]) == 0.8  # order of the points does not matter
    assert goodput([(0.2, 0.5), (0.4, 1.0)]) is None
    assert goodput([]) is None
    assert goodput([(0.2, 0.8), (0.4, 0.75)], target=0.75) == 0.4


def test_sweep_gives_attainment_per_rate_and_scale_and_goodput_per_core():
    fast, slow = record(0.3, [0.02] * 10), record(0.8, [0.02] * 10)
    runs = {
        ("colocated", 0.2): [fast] * 10,
        ("colocated", 0.4): [fast] * 9 + [slow],
        ("disagg", 0.2): [slow] * 10,
        ("disagg", 0.4): [slow] * 5 + [record(3.0, [0.02])] * 5,
    }
    scales = parse_scales("0.5,1,2")
    points, goodputs = sweep(runs, BASE, scales, cores=2)
    shares = {(p.label, p.rate, p.scale): p.attainment for p in points}
    assert shares[("colocated", 0.4, "tight")] == 0.9
    assert shares[("disagg", 0.2, "tight")] == 0.0
    assert shares[("disagg", 0.4, "loose")] == 0.5
    by = {(g.label, g.scale): (g.goodput, g.per_core) for g in goodputs}
    assert by[("colocated", "tight")] == (0.4, 0.2)
    assert by[("disagg", "tight")] == (None, None)
    assert by[("disagg", "medium")] == (0.2, 0.1)
    text = format_sweep(points, goodputs, BASE, scales)
    assert "colocated" in text and "90%" in text and "0.2/core" in text
    body = sweep_json(points, goodputs, BASE, scales, cores=2)
    assert body["scales"] == {"tight": 0.5, "medium": 1.0, "loose": 2.0}
    assert len(body["attainment"]) == 12 and body["cores"] == 2


def test_parse_reads_the_base_objective_and_the_scales():
    assert SloObjective.parse("ttft_ms=3000,tpot_ms=50,gap_ms=250") == SloObjective(3000, 50, 250)
    assert parse_scales("strict=0.25,1,lax=4") == (
        ("strict", 0.25),
        ("medium", 1.0),
        ("lax", 4.0),
    )
    for bad, message in [
        ("", "at least one"),
        ("gap_ms=inf", "> 0"),
        ("ttft_ms=3000,tpot_ms=50,gap_ms=x", "not a number"),
        ("ttft=1,tpot_ms=50,gap_ms=1", "expected NAME=MS"),
        ("ttft_ms=0,tpot_ms=50,gap_ms=1", "> 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            SloObjective.parse(bad)
    for bad in ("1,2", "2,1,3", "0,1,2", "1,1,2"):
        with pytest.raises(ValueError, match="--slo-scales"):
            parse_scales(bad)


def test_a_limit_left_out_is_no_limit_and_is_written_as_null():
    gaps_only = SloObjective.parse("gap_ms=100")
    assert (gaps_only.ttft_ms, gaps_only.tpot_ms, gaps_only.gap_p99_ms) == (math.inf, math.inf, 100)
    assert gaps_only.is_met(record(60.0, [0.09] * 50))  # a minute to the first token: no limit
    assert not gaps_only.is_met(record(0.1, [0.02] * 95 + [0.5] * 5))
    assert not gaps_only.is_met(record(0.1, [0.02], error="timeout"))
    assert gaps_only.scaled(2) == SloObjective(gap_p99_ms=200)
    assert gaps_only.describe() == "p99 gap <= 100 ms"
    assert BASE.describe() == "TTFT <= 1000 ms, TPOT <= 50 ms, p99 gap <= 200 ms"
    body = sweep_json(
        *sweep({("a", 0.1): [record(0.1, [0.01])]}, gaps_only),
        gaps_only,
        parse_scales("0.5,1,2"),
        cores=1,
    )
    written = orjson.loads(orjson.dumps(body))["base"]
    assert written == {"ttft_ms": None, "tpot_ms": None, "gap_p99_ms": 100}
    assert SloObjective(**written) == gaps_only  # as sim --slo-measured reads it back
    with pytest.raises(ValueError, match="at least one"):
        SloObjective()
