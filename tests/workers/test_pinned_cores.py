"""Two meshes on one host (issue 45: both pinned their decode worker to CPU 1): ``kvmesh up``
reads the cores other meshes' workers are pinned to from their command lines and pins its own
elsewhere, or says that it shares them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.proc_tree import reaped

from kvmesh.commands import pinned_cores, up_plan
from kvmesh.commands.launcher import Launcher
from kvmesh.commands.pinned_cores import parse_worker, pinned_workers, pinning_note
from kvmesh.commands.up_config import UpConfig
from kvmesh.commands.up_plan import cpu_plan, plan


def _pins(cpus) -> dict[str, frozenset[int]]:
    return {role: p.cpus for role, p in cpus.roles.items()}


@pytest.fixture
def four_cpus(monkeypatch):
    """A machine of four CPUs, as kvmesh up sees it."""
    monkeypatch.setattr(up_plan.os, "sched_getaffinity", lambda _: {0, 1, 2, 3})


@pytest.fixture
def other_mesh():
    """Another mesh's decode worker, pinned to CPU 3: a process with its command line."""
    argv = [sys.executable, "-c", "import time; time.sleep(120)", "-m", "kvmesh.cli", "serve"]
    argv += ["decode", "--worker-id", "decode-0", "--mesh", "other", "--threads", "1"]
    proc = subprocess.Popen([*argv, "--cpus", "3"])
    with reaped(proc):
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        deadline = time.monotonic() + 30
        while not cmdline.read_bytes():  # empty until its exec is done
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield proc


def test_a_workers_command_line_names_its_mesh_and_cores(four_cpus) -> None:
    specs = plan(UpConfig(model="kvmesh-tiny"), "nats://127.0.0.1:4222", 8000)
    workers = [parse_worker(7, ["python", "-m", "kvmesh.cli", *s.argv]) for s in specs]
    pinned = {w.worker_id: (w.mesh, w.cpus) for w in workers if w is not None}
    assert pinned == {"decode-0": ("kvmesh-tiny", {3}), "prefill-0": ("kvmesh-tiny", {0, 1, 2})}
    assert parse_worker(7, ["python", "-m", "other", "serve", "x", "--cpus", "1"]) is None


def test_a_second_mesh_pins_its_workers_to_cores_the_first_leaves(
    four_cpus, other_mesh, monkeypatch, capsys
):
    seen = [w for w in pinned_workers() if w.pid == other_mesh.pid]
    assert [(w.mesh, w.worker_id, w.cpus) for w in seen] == [("other", "decode-0", {3})]
    # only that one: meshes of other tests on this machine are not this test's
    monkeypatch.setattr(pinned_cores, "pinned_workers", lambda: seen)
    config = UpConfig(model="kvmesh-tiny")
    assert _pins(cpu_plan(config))["decode"] == {3}  # alone, it would take CPU 3 too
    cpus = Launcher(config)._plan_cpus()
    assert _pins(cpus) == {"decode": {2}, "prefill": {0, 1}}
    err = capsys.readouterr().err
    assert f"CPUs 3 are pinned by decode-0 of mesh 'other' (pid {other_mesh.pid})" in err
    assert "this mesh pins its workers to CPUs 0-2" in err


def test_too_few_free_cores_are_shared_and_said_to_be(four_cpus) -> None:
    config = UpConfig(model="kvmesh-tiny")
    cpus = cpu_plan(config, taken=frozenset({0, 1, 3}))  # one core left: nothing to partition
    assert _pins(cpus) == {"decode": {3}, "prefill": {0, 1, 2}}
    others = [parse_worker(9, ["kvmesh", "serve", "decode", "--mesh", "m", "--cpus", "0-1,3"])]
    note = pinning_note(_pins(cpus)["decode"] | _pins(cpus)["prefill"], others)
    assert note.startswith("warning: CPUs 0-1,3 are pinned by decode of mesh 'm' (pid 9) too")
    assert "taskset -c" in note
    wanted = cpu_plan(UpConfig(model="kvmesh-tiny", cores=3), taken=frozenset({3}))
    assert _pins(wanted) == {"decode": {2}, "prefill": {0, 1}}  # --cores 3 fit in the free three
    assert pinning_note(frozenset({1}), []) == ""  # no other mesh pins: nothing to say
