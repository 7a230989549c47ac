"""A tensor-parallel group's liveness (shared/engine/tp_leader.py, tp_ranks.py): an idle leader
keeps its followers waiting past the collective timeout (keepalives), and a follower that hangs
(SIGSTOP: alive, silent) fails the leader's next call within that timeout, marks it broken and
takes the worker down through ``RankProcesses.watch``: not the 300 s of the group's start."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from typing import Any

import pytest
from kvmesh.shared.engine.tp_ranks import RankProcesses, TPGroupError

TIMEOUT_S = 1.0  # the group's collective timeout here (TP_COLLECTIVE_TIMEOUT_S in a worker)
IDLE_S = 3.0  # the leader's idle spell: three timeouts


class SumEngine:
    """An engine whose ``step`` is one all-reduce across the ranks, as a sharded forward's."""

    def step(self) -> float:
        import torch
        import torch.distributed as dist

        x = torch.ones(4)
        dist.all_reduce(x)
        return float(x[0])


def rank_main(rank: int, port: int, results: Any, go: str) -> None:
    from kvmesh.shared.engine.tp_leader import LeaderEngine, follow
    from kvmesh.shared.engine.tp_ranks import join_group

    join_group(rank, 2, port, collective_timeout_s=TIMEOUT_S)
    if rank == 1:
        results.put(("follower", os.getpid()))
        try:
            follow(SumEngine())
        except RuntimeError as exc:
            results.put(("follower_error", type(exc).__name__))
        return
    broken: list[str] = []
    leader = LeaderEngine(SumEngine(), on_broken=lambda e: broken.append(str(e)), keepalive_s=0.2)
    time.sleep(IDLE_S)  # the follower waits for the next call all along: kept alive
    results.put(("after_idle", leader.step()))
    results.put(("stop_follower", None))
    assert go_ahead(go)  # the test has stopped the follower
    started = time.monotonic()
    try:
        leader.step()
        results.put(("hung_step", "returned"))
    except TPGroupError:
        results.put(("hung_step", time.monotonic() - started))
    started = time.monotonic()
    try:
        leader.step()
    except TPGroupError:
        results.put(("next_step", time.monotonic() - started))
    results.put(("broken", broken))
    results.put(("closed", leader.close()))


def go_ahead(path: str) -> bool:
    """Wait for the test to say it stopped the follower (the file ``path``)."""
    deadline = time.monotonic() + 30
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_idle_leader_keeps_its_followers_and_a_hung_one_breaks_the_group_in_the_timeout(
    tmp_path: Any,
) -> None:
    from kvmesh.shared.config.ports import free_port

    go = tmp_path / "go"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=rank_main, args=(r, port, results, str(go)), daemon=True) for r in (0, 1)
    ]
    for proc in procs:
        proc.start()
    seen: dict[str, Any] = {}
    try:
        while "closed" not in seen:
            key, value = results.get(timeout=60)
            seen[key] = value
            if key == "stop_follower":
                os.kill(seen["follower"], signal.SIGSTOP)
                go.touch()
    finally:
        for proc in procs:
            proc.kill()
            proc.join()
    assert seen["after_idle"] == 2.0  # the follower was still there after three timeouts idle
    hung = seen["hung_step"]
    assert hung != "returned", "a step over a stopped follower returned"
    assert hung < TIMEOUT_S + 2.0, f"the hung follower held the leader {hung:.1f} s"
    assert seen["next_step"] < 0.5  # broken: later calls fail at once, no second wait
    assert len(seen["broken"]) == 1
    assert seen["closed"] is False  # nothing to tell a broken group


def test_a_broken_group_takes_the_worker_down_through_watch() -> None:
    class Alive:
        exitcode = None

        def is_alive(self) -> bool:
            return True

    ranks = RankProcesses([Alive()], "prefill")
    assert ranks.first_exited() is None
    ranks.mark_broken(RuntimeError("gloo: timed out waiting 60000ms"))
    ranks.mark_broken(RuntimeError("a second failure"))  # the first one says why
    with pytest.raises(TPGroupError, match=r"group of 2 broken.*60000ms.*prefill worker goes down"):
        asyncio.run(ranks.watch(interval_s=0.01))
