"""``kvmesh sim``: one topology, the planner, and refusals of bad input."""

from __future__ import annotations

import pytest

from kvmesh.cli import main

SMALL = [
    "--num-requests",
    "30",
    "--request-rate",
    "1",
    "--input-len-range",
    "2000:4000",
    "--output-len-range",
    "32:64",
]


def test_sim_prints_one_topology_row(capsys):
    assert main(["sim", "--mode", "colocated", "--decode", "2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "| colocated x2 (chunk 2048) |" in out
    assert "30/30" in out


@pytest.mark.slow  # seconds: left out of make test-fast
def test_sim_plan_prints_three_rows_and_reasons(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["sim", "--plan", "--gpus", "4", *SMALL, "--plot-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "colocated x4 (no chunking)" in out
    assert "colocated x4 (chunk 2048)" in out
    assert "| planner: disagg " in out
    assert "\nplanner: " in out
    assert (tmp_path / "sim_itl_over_time.png").stat().st_size > 0
    assert (tmp_path / "sim_goodput_vs_split.png").stat().st_size > 0


def test_sim_refuses_an_unknown_device(capsys):
    assert main(["sim", "--device", "nope", *SMALL]) == 2
    assert "no device spec 'nope'" in capsys.readouterr().err


def test_sim_refuses_an_sla_without_itl(capsys):
    assert main(["sim", "--sla", "ttft_ms=100", *SMALL]) == 2
    assert "--sla needs both" in capsys.readouterr().err


def test_sim_validate_refuses_no_repeats(capsys):
    assert main(["sim", "--validate", "--repeats", "0", *SMALL]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_sim_calibrate_refuses_no_probe_runs(capsys):
    assert main(["sim", "--calibrate", "--model", "kvmesh-tiny", "--probe-runs", "0"]) == 2
    assert "--probe-runs must be at least 1" in capsys.readouterr().err
