"""`kvmesh bench xfer`: JSON schema, byte verification, CLI wiring."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
import torch
from kvmesh.loadgen.bench_xfer import BLOCK_BYTES, XferPlan, format_table, parse_size, register_xfer
from kvmesh.loadgen.xfer_backends import SPEC, blocks_crc, fill_source
from kvmesh.shared.kv.kv_cache import KVPool


def test_bench_xfer_json_reports_every_backend_after_verifying_bytes():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.loadgen.bench_xfer",
            "--json",
            "--sizes",
            "4M",
            "--repeats",
            "1",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert set(doc) == {"results"}
    rows = doc["results"]
    backends = [r["backend"] for r in rows]
    assert {"memcpy", "socket", "gloo", "shm", "tcp"} <= set(backends)
    assert len(backends) == len(set(backends))
    for row in rows:
        assert set(row) == {"backend", "bytes", "gbps"}
        assert row["bytes"] == 4 << 20
        assert isinstance(row["gbps"], float) and row["gbps"] > 0


def test_plan_scatters_distinct_blocks_inside_a_larger_pool():
    plan = XferPlan.make(64 << 20, seed=1)
    assert len(plan.src_blocks) == len(set(plan.src_blocks)) == 32
    assert len(plan.dst_blocks) == len(set(plan.dst_blocks)) == 32
    assert plan.pool_blocks > 32
    assert max(plan.src_blocks + plan.dst_blocks) < plan.pool_blocks
    assert list(plan.dst_blocks) != sorted(plan.dst_blocks)  # scattered, not a contiguous run


def test_checksum_catches_a_block_that_did_not_arrive():
    plan = XferPlan.make(8 << 20, seed=0)
    src = KVPool(SPEC, plan.pool_blocks)
    fill_source(src, plan.src_blocks)
    dst = KVPool(SPEC, plan.pool_blocks)
    pairs = list(zip(plan.src_blocks, plan.dst_blocks, strict=True))
    for s, d in pairs[:-1]:
        dst.block_bytes_view(d).copy_(src.block_bytes_view(s))
    assert blocks_crc(dst, plan.dst_blocks) != blocks_crc(src, plan.src_blocks)
    s, d = pairs[-1]
    dst.block_bytes_view(d).copy_(src.block_bytes_view(s))
    assert blocks_crc(dst, plan.dst_blocks) == blocks_crc(src, plan.src_blocks)


def test_llama3_8b_block_is_two_mib():
    assert SPEC.block_bytes == BLOCK_BYTES == 2 << 20 and SPEC.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("text", "value"), [("16M", 16 << 20), ("1G", 1 << 30), ("64MiB", 64 << 20)]
)
def test_parse_size_accepts_suffixes(text, value):
    assert parse_size(text) == value


def test_parse_size_rejects_a_partial_block():
    with pytest.raises(argparse.ArgumentTypeError, match="multiple"):
        parse_size("3M")


def test_register_xfer_adds_the_subcommand_with_its_handler():
    parser = argparse.ArgumentParser()
    register_xfer(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["xfer", "--json", "--sizes", "16M,64M", "--backends", "shm,tcp"])
    assert args.json and args.sizes == "16M,64M" and args.backends == "shm,tcp"
    assert callable(args.func)


def test_table_shows_ratios_against_each_baseline():
    from kvmesh.loadgen.bench_xfer import Result

    table = format_table(
        [
            Result("memcpy", 16 << 20, 10.0),
            Result("socket", 16 << 20, 2.0),
            Result("gloo", 16 << 20, 1.0),
            Result("tcp", 16 << 20, 4.0),
        ]
    )
    tcp_line = next(line for line in table.splitlines() if " tcp " in line)
    assert tcp_line.split()[-4:] == ["4.00", "0.40", "2.00", "4.00"]


def test_asking_for_rdma_without_a_device_exits_2_with_the_reason(capsys):
    from kvmesh.loadgen.bench_xfer import run
    from kvmesh.shared.transport.rdma import rdma_available

    ok, why = rdma_available()
    if ok:
        pytest.skip("an RDMA device exists here")
    args = argparse.Namespace(
        sizes="4M", backends="rdma", json=True, repeats=1, warmup=0, seed=0, rounds=1
    )
    assert run(args) == 2
    assert why in capsys.readouterr().err


def test_tcp_unix_moves_every_block_over_the_same_host_socket_and_is_not_a_default():
    from kvmesh.loadgen.bench_xfer import default_backends
    from kvmesh.loadgen.xfer_backends import bench_backend

    (result,) = bench_backend("tcp-unix", [XferPlan.make(4 << 20, seed=0, runs=2)], warmup=1)
    assert result.backend == "tcp-unix" and result.gbps > 0  # every block checked on arrival
    assert "tcp-unix" not in default_backends()
