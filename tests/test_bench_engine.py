"""`kvmesh bench engine`: the JSON the issue asks for, from a short real run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("kernels", [[], ["--no-cpu-kernels"]])
def test_bench_engine_json_has_both_systems_and_every_batch_size(kernels):
    short = ["--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4"]
    short += ["--batch-sizes", "1,3", "--repeats", "1", *kernels]
    proc = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "bench", "engine", "--json", *short],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for system in ("kvmesh", "transformers"):
        assert result[system]["prefill_tok_s"] > 0
        assert set(result[system]["decode_tok_s"]) == {"1", "3"}
        assert all(v > 0 for v in result[system]["decode_tok_s"].values())
    assert result["config"]["greedy_outputs_match"] is True
    assert result["config"]["cpu_kernels"] is (not kernels)
    assert set(result["ratios"]["decode"]) == {"1", "3"}
