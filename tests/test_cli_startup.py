"""Start-up stays fast: building the CLI parser imports no torch, and loading a model (what
every prefill, decode and draft worker does first) imports none of torch's compiler stack."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import kvmesh.cli
parser = kvmesh.cli.build_parser()
for argv in (["--help"], ["bench", "--help"], ["bench", "xfer", "--help"]):
    try:
        parser.parse_args(argv)
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_cli_help_does_not_import_torch():
    # A fresh interpreter: in this one, other tests may already have imported torch.
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


_LOAD_PROBE = """
import sys
from kvmesh.shared.model.loader import load_model
load_model("kvmesh-tiny")
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_model_imports_no_dynamo_sympy_or_triton():
    # torch's meta-device init and empty_like go through Python references that import them:
    # seconds of CPU at every worker's start (the loader avoids both)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
