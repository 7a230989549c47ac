"""scripts/gpu_check.py (`make gpu-check`) on a machine without a GPU: its dry run executes every
benchmark's code on the CPU at tiny sizes and prints one JSON labelled as a dry run; without CUDA
the real run says so in one line; the SoftRoCE attempt records each step's exact error; pytest's
JUnit report becomes one outcome per test. Keeps the GPU script from rotting between the rare
sessions that have a GPU (docs/gpu.md)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def test_dry_run_prints_one_json_of_every_benchmark_labelled_as_dry_run():
    proc = _script("--device", "cpu", "--no-tests")

    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["mode"] == "cpu-dry-run" and "none of these figures" in summary["note"]
    assert summary["versions"]["torch"] == torch.__version__
    benches = summary["benchmarks"]
    assert set(benches) == {"kv_pack", "paged_decode_attention", "engine_decode", "quant_matmul"}
    for name, result in benches.items():
        assert "error" not in result, (name, result)
        assert result["dry_run"] is True and result["meets_goal"] == "n/a (dry run)"
    assert benches["kv_pack"]["pack"]["gb_per_s"] > 0 and benches["kv_pack"]["scatter"]["ratio"] > 0
    attention = benches["paged_decode_attention"]["batches"]
    assert set(attention) == {"1", "2"}
    assert all(row["max_abs_err"] < 1e-4 for row in attention.values())  # float32, same data
    quant = benches["quant_matmul"]["formats"]
    assert set(quant) == {"Q4_1", "Q4_K"}
    for fmt in quant.values():  # float32, the same weight: the kernel is its reference
        assert all(row["max_abs_err"] < 1e-4 for row in fmt["rows"].values())
        assert all(row["kernel_weight_gb_per_s"] > 0 for row in fmt["rows"].values())
    engine = benches["engine_decode"]["batches"]
    for row in engine.values():
        assert row["engine_tok_per_s"] > 0 and row["transformers_tok_per_s"] > 0
        # float32 on the CPU: the engine and transformers agree on every greedy token
        assert row["greedy_tokens_equal_before_first_difference_mean"] == row["tokens_per_request"]
    assert summary["softroce"].startswith("not attempted")


@no_cuda_only
def test_without_cuda_the_real_run_says_so_in_one_line_and_exits_0():
    proc = _script()

    assert proc.returncode == 0
    assert proc.stdout.strip().count("\n") == 0 and "no CUDA device" in proc.stdout


@no_cuda_only
def test_gpu_tests_skip_with_the_reason_without_cuda():
    result = _module().run_pytest(
        [
            "-m",
            "gpu",
            "tests/gpu/test_gpu_kernels.py::test_decode_kernel_matches_sdpa_on_unpaged_data_on_cuda",
        ],
        env=dict(os.environ),
        timeout=120,
    )

    assert result["counts"] == {"passed": 0, "failed": 0, "error": 0, "skipped": 1}
    assert result["tests"][0]["detail"] == "no CUDA device"


def test_parse_junit_gives_each_outcome_and_its_reason():
    xml = """<testsuites><testsuite>
      <testcase classname="tests.test_a" name="test_ok" time="0.5"/>
      <testcase classname="tests.test_a" name="test_bad" time="1"><failure message="assert 1 == 2">trace</failure></testcase>
      <testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="no CUDA device"/></testcase>
      <testcase classname="tests.test_b" name="test_err" time="0"><error message="fixture broke"/></testcase>
    </testsuite></testsuites>"""

    report = _module().parse_junit(xml)

    assert report["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    outcomes = {row["test"]: (row["outcome"], row.get("detail")) for row in report["tests"]}
    assert outcomes == {
        "tests.test_a::test_ok": ("passed", None),
        "tests.test_a::test_bad": ("failed", "assert 1 == 2"),
        "tests.test_b::test_skip": ("skipped", "no CUDA device"),
        "tests.test_b::test_err": ("error", "fixture broke"),
    }


class _FakeRun:
    """Answers commands from a table of (returncode, output); records what ran."""

    def __init__(self, answers: dict[str, tuple[int, str]]) -> None:
        self.answers = answers
        self.calls: list[str] = []

    def __call__(self, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
        cmd = " ".join(argv)
        self.calls.append(cmd)
        rc, out = self.answers.get(argv[0] + " " + argv[1], (0, ""))
        return subprocess.CompletedProcess(argv, rc, "", out)


def test_softroce_attempt_records_the_exact_error_when_modprobe_fails():
    error = "modprobe: FATAL: Module rdma_rxe not found in directory /lib/modules/6.8.0"
    run = _FakeRun({"modprobe rdma_rxe": (1, error)})

    result = _module().softroce_attempt(run, netdev="eth0", rdma_tests=lambda: {"ran": True})

    assert result["working"] is False and error in result["error"]
    assert run.calls == ["modprobe rdma_rxe"] and "rdma_tests" not in result


def test_softroce_attempt_records_rdma_link_add_failure():
    run = _FakeRun({"rdma link": (255, "error: Operation not permitted")})

    result = _module().softroce_attempt(run, netdev="ens5")

    assert result["error"] == "rdma link add failed: error: Operation not permitted"
    assert run.calls == ["modprobe rdma_rxe", "rdma link add rxe0 type rxe netdev ens5"]


def test_softroce_attempt_runs_the_rdma_tests_once_the_link_exists():
    run = _FakeRun({})

    result = _module().softroce_attempt(run, netdev="eth0", rdma_tests=lambda: {"counts": "x"})

    assert result["working"] is True and result["rdma_tests"] == {"counts": "x"}
    assert run.calls[-1] == "rdma link show"


def test_first_netdev_skips_lo(tmp_path):
    for name in ("lo", "eth1", "eth0"):
        (tmp_path / name).mkdir()

    assert _module().first_netdev(tmp_path) == "eth0"
