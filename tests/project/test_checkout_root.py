"""Run from a checkout's root (``python -m``, ``make test``, ``make up``), kvmesh takes that root
off ``sys.path``: its ``kernels/`` would shadow Hugging Face's ``kernels`` package, which
transformers >= 5.25 imports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json, sys
from pathlib import Path
before = any(Path(p or ".").resolve() == Path.cwd() for p in sys.path)
import kvmesh
after = any(Path(p or ".").resolve() == Path.cwd() for p in sys.path)
spec = importlib.util.find_spec("kernels")
print(json.dumps({"before": before, "after": after, "kernels": spec and spec.origin}))
"""


def test_importing_kvmesh_in_the_checkout_root_takes_the_root_off_sys_path():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["before"], "python -c puts the working directory on sys.path"
    assert not seen["after"], "the checkout's root is still an import root"
    assert seen["kernels"] is None or not seen["kernels"].startswith(str(REPO / "kernels")), seen


def test_kvmesh_keeps_sys_path_elsewhere(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout)
    assert seen["before"] and seen["after"], seen
