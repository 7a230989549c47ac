"""``kvmesh --help`` stays fast: building the CLI parser imports no torch."""

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
