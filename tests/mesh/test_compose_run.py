"""`make compose-test` from `make test`, where this machine already runs Docker.

The stack run for real (scripts/compose_test.py: images built with no registry, the default
model, up scaled, completions, replicas, Prometheus, a decode container killed under load,
down -v) takes 2-5 minutes once the base image is cached, and installing Docker and making the
base image take more. So the suite runs it only where a Docker daemon already answers and the
offline base image is built; elsewhere it skips and says how to run it (`make compose-test`
installs Docker with apt, starts a daemon and builds the base image itself).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import compose_host as host  # noqa: E402


def _why_not() -> str:
    """Why this machine cannot run the stack within the suite ("" when it can)."""
    if not host.daemon_answers():  # also where there is no docker client
        return "no Docker daemon answers"
    if host.compose_command() is None:
        return "no docker compose (v2 plugin) nor docker-compose (v1)"
    have = subprocess.run(
        ["docker", "image", "inspect", host.BASE_IMAGE], capture_output=True, timeout=30
    )
    if have.returncode != 0:
        return f"the offline base image {host.BASE_IMAGE} is not built yet"
    return ""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_compose_stack_serves_scales_survives_a_killed_decode_and_leaves_nothing(tmp_path):
    why = _why_not()
    if why:
        pytest.skip(f"{why}: run `make compose-test` (it installs and starts what it needs)")
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compose_test.py"), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    lines = [ln for ln in result.stdout.splitlines() if ln.startswith("compose-test: ")]
    print("\n".join(lines))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    passed = [ln for ln in lines if ln.startswith("compose-test: PASS ")]
    checks = {ln.split()[2].rstrip(":") for ln in passed}
    assert {"completions", "replicas", "prometheus", "decode-kill", "down"} <= checks, lines
