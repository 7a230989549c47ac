"""`kvmesh bench kv`: read against write GB/s per transport, bytes verified, CLI wiring."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvmesh.loadgen.bench_kv import KvResult, format_table, register_kv


def test_bench_kv_json_reports_read_and_write_per_transport_after_verifying_bytes() -> None:
    args = ["--json", "--sizes", "4M", "--repeats", "1", "--rounds", "1", "--backends", "shm,tcp"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.loadgen.bench_kv", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["results"]
    assert sorted(r["backend"] for r in rows) == ["shm", "tcp"]
    for row in rows:
        assert set(row) == {"backend", "bytes", "write_gbps", "read_gbps", "read_over_write"}
        assert row["bytes"] == 4 << 20
        assert row["write_gbps"] > 0 and row["read_gbps"] > 0
        assert abs(row["read_over_write"] - row["read_gbps"] / row["write_gbps"]) < 0.01


def test_bench_kv_refuses_an_unknown_backend() -> None:
    parser = argparse.ArgumentParser()
    register_kv(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["kv", "--backends", "memcpy"])
    assert args.func(args) == 2


def test_format_table_shows_the_read_over_write_ratio() -> None:
    table = format_table([KvResult("tcp", 64 << 20, 4.0, 3.0)])
    assert "64 MiB" in table and "0.75" in table
