"""kvmesh bench tp (loadgen/bench_tp.py): the report it prints from its runs, and its refusals.
The runs themselves (rank processes, gloo) are what tests/model/test_tensor_parallel.py checks."""

from __future__ import annotations

import argparse

import pytest
from kvmesh.loadgen.bench_tp import format_report, register_tp, tp_report


def test_report_compares_tp_with_tp1_threads_and_one_thread():
    one, tp1, tp2 = (
        {"best_s": 1.5, "first_token": 7},
        {"best_s": 1.0, "first_token": 7},
        {"best_s": 0.8, "first_token": 7},
    )
    r = tp_report("seeded-23m", 2, 1024, one, tp1, tp2)
    assert r["speedup"] == pytest.approx(1.25)
    assert r["speedup_over_one_thread"] == pytest.approx(1.875)
    assert r["same_first_token"]
    text = format_report(r)
    assert "TP1, 2 threads" in text and "800.0 ms" in text and "x1.25" in text
    assert "first token the same" in text
    r = tp_report("m", 2, 8, one, tp1, {"best_s": 0.8, "first_token": 8})
    assert not r["same_first_token"] and "DIFFERS" in format_report(r)


def test_bench_tp_refuses_a_tp_degree_below_two():
    parser = argparse.ArgumentParser()
    register_tp(parser.add_subparsers())
    args = parser.parse_args(["tp", "--tp", "1"])
    with pytest.raises(SystemExit, match="--tp must be at least 2"):
        args.func(args)
