"""How kvmesh up shares the cores (kvmesh/commands/cpu_plan.py) and how a worker applies its
share (shared/config/cpu_placement.py): affinity, SCHED_IDLE, nice, and its autogroup's nice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh.shared.config.cpu_placement import (
    CpuPlacement,
    autogroup_enabled,
    format_cpu_list,
    parse_cpu_list,
)

from kvmesh.commands.cpu_plan import PASSIVE, SPARE, RolePlan, plan_cpus

TWO = frozenset({0, 1})


def disagg(cpus=TWO, **kw):
    kw.setdefault("decode_workers", 1)
    kw.setdefault("prefill_workers", 1)
    return plan_cpus(cpus, mode="disagg", device="cpu", **kw)


def test_priority_gives_decode_every_core_first_and_prefill_the_idle_cycles() -> None:
    plan = disagg(sharing="priority")
    assert plan.roles["decode"] == RolePlan(2, env=PASSIVE)
    assert plan.roles["prefill"] == RolePlan(2, idle=True)
    assert plan.roles["prefill"].flags() == ("--threads", "2", "--sched-idle")
    nice = disagg(sharing="priority", prefill_nice=10, prefill_workers=2)
    assert nice.roles["prefill"] == RolePlan(1, nice=10)
    assert "nice 10" in nice.describe()


def test_partition_pins_each_pool_to_cores_of_its_own() -> None:
    plan = disagg(sharing="partition-strict")
    assert plan.roles["decode"] == RolePlan(1, frozenset({1}))
    assert plan.roles["prefill"] == RolePlan(1, frozenset({0}))
    twelve = disagg(frozenset(range(4, 16)), sharing="partition-strict")
    assert twelve.roles["decode"].cpus == frozenset(range(12, 16))
    assert twelve.roles["prefill"] == RolePlan(8, frozenset(range(4, 12)))
    assert twelve.roles["decode"].flags() == ("--threads", "4", "--cpus", "12-15")
    one = disagg(frozenset({3}), sharing="partition")
    assert one.roles["decode"].cpus == one.roles["prefill"].cpus == frozenset({3})
    assert not one.roles["prefill"].borrow  # decode's core is its own: nothing to borrow


def test_partition_lends_decodes_cores_to_a_single_prefill_worker_while_decode_is_idle() -> None:
    plan = disagg(sharing="partition")
    assert plan.roles["decode"] == RolePlan(1, frozenset({1}))
    assert plan.roles["prefill"] == RolePlan(1, frozenset({0}), borrow=frozenset({1}))
    assert plan.roles["prefill"].flags() == (
        "--threads", "1", "--cpus", "0", "--borrow-cpus", "1",
    )  # fmt: skip
    assert "borrowing CPUs 1 while decode is idle" in plan.describe()
    twelve = disagg(frozenset(range(4, 16)))  # auto
    assert twelve.roles["prefill"].borrow == frozenset(range(12, 16))
    # several prefill workers: another's delivery could start a stream during one's loan
    assert not disagg(sharing="partition", prefill_workers=2).roles["prefill"].borrow
    assert not disagg(sharing="partition-spare", prefill_workers=2).roles["prefill"].borrow


def test_partition_spare_makes_the_last_of_several_prefill_workers_a_spare_at_sched_idle() -> None:
    both = disagg(sharing="partition", prefill_workers=2)  # two pinned workers, no spare, no loan
    assert both.roles == {
        "decode": RolePlan(1, frozenset({1})),
        "prefill": RolePlan(1, frozenset({0})),
    }
    plan = disagg(sharing="partition-spare", prefill_workers=2)
    assert plan.roles["prefill"] == RolePlan(1, frozenset({0}))
    assert plan.roles[SPARE] == RolePlan(1, idle=True)  # any core, on idle cycles
    assert plan.roles[SPARE].flags() == ("--threads", "1", "--sched-idle")
    three = disagg(frozenset(range(6)), sharing="partition-spare", prefill_workers=3)
    assert three.roles["prefill"] == RolePlan(2, frozenset(range(4)))  # 4 cores, 2 pinned workers
    assert SPARE not in disagg(sharing="partition-spare").roles  # one worker: no spare


def test_auto_chooses_by_device_and_says_why() -> None:
    auto = disagg()
    assert auto.sharing == "partition" and "cores of its own" in auto.why
    assert disagg(frozenset({0})).sharing == "equal"  # one core: nothing to partition
    nice = disagg(prefill_nice=5)
    assert nice.sharing == "priority" and nice.roles["prefill"].nice == 5
    unpinnable = disagg(frozenset(range(12)), sharing="partition", pinnable=False)
    assert unpinnable.sharing == "equal" and "none to pin" in unpinnable.why
    gpu = plan_cpus(TWO, mode="disagg", device="cuda", decode_workers=1, prefill_workers=1)
    assert gpu.sharing == "equal" and "cuda" in gpu.why
    assert gpu.threads() == {"decode": 1, "prefill": 2}
    colocated = plan_cpus(TWO, mode="colocated", device="cpu", decode_workers=1, prefill_workers=0)
    assert colocated.threads() == {"colocated": 2}
    with pytest.raises(ValueError, match="cpu_sharing must be one of"):
        disagg(sharing="fair")


def test_cpu_lists_parse_and_print_as_the_kernel_writes_them() -> None:
    assert parse_cpu_list("0-2,5") == frozenset({0, 1, 2, 5})
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    for bad in ("", "x", "3-1", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="nice must be in"):
        CpuPlacement(nice=20)


CHILD = """
import os, sys
from pathlib import Path
from kvmesh.shared.config.cpu_placement import CpuPlacement
out = Path(sys.argv[1])
done = CpuPlacement(frozenset({int(sys.argv[2])}), idle=True).apply(autogroup=out / "autogroup")
import threading
seen = {}
def probe():
    seen["policy"] = os.sched_getscheduler(0)
    seen["cpus"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=probe); t.start(); t.join()
print(repr(done), seen["policy"] == os.SCHED_IDLE, seen["cpus"])
"""


def test_a_worker_applies_its_placement_to_the_threads_it_starts_later(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(cpu)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    done, idle, cpus = run.stdout.strip().rsplit(" ", 2)
    assert idle == "True" and cpus == f"[{cpu}]"
    assert f"cpus {cpu}" in done and "SCHED_IDLE" in done
    if autogroup_enabled():  # the session's weight follows, written where it was told
        assert "autogroup nice 19" in done
        assert (tmp_path / "autogroup").read_text() == "19"
