"""The processes of a tensor-parallel worker's ranks, whichever the worker (docs/tp.md).

A TP worker is one process that serves (rank 0, the leader) and N-1 it spawns (its followers);
the prefill worker (``services/prefill/tp_group.py``) and the decode worker
(``services/decode/tp_group.py``) start and watch them with this: ``spawn_ranks`` starts each
follower on its share of the worker's CPUs (``cpu_shares``, ``rank_threads``), ``join_group``
meets them in one gloo group over 127.0.0.1, ``RankProcesses.watch`` raises once a follower has
exited (the leader then goes down and takes the worker with it), and a follower calls
``exit_with_leader`` so that it never outlives its leader (nor holds anything after it).

Torch-free at import: ``torch.distributed`` is imported when the group forms.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

TP_INIT_TIMEOUT_S = 300.0  # the followers load the model before the group forms
# Once formed, a collective that waits longer than this fails: a rank that hangs (stopped,
# swapped out, deadlocked) takes its worker down within it rather than in TP_INIT_TIMEOUT_S.
# An idle leader keeps its followers' wait for the next call under it (``LeaderEngine``'s
# keepalive). Long enough for a rank's slowest step between two collectives on a loaded box.
TP_COLLECTIVE_TIMEOUT_S = 60.0


class TPGroupError(RuntimeError):
    """A rank of a tensor-parallel worker is gone: the worker goes down as a whole."""


def cpu_shares(cpus: list[int], tp: int) -> list[list[int]]:
    """Each rank's CPUs: the worker's split into ``tp`` runs of equal length when there are
    enough; all of them for every rank otherwise (the ranks then share them)."""
    if len(cpus) < tp:
        return [cpus] * tp
    per_rank = len(cpus) // tp
    return [cpus[r * per_rank : (r + 1) * per_rank] for r in range(tp)]


def rank_threads(threads: int | None, num_cpus: int, tp: int) -> int:
    """Torch threads of each rank: an equal share of the worker's (``threads``, default one a
    CPU of its ``num_cpus``), at least one."""
    return max(1, (threads or num_cpus) // tp)


class RankProcesses:
    """The leader's side: its follower processes (ranks 1..N-1), watched."""

    def __init__(self, processes: list[Any], role: str) -> None:
        self.processes = processes
        self.role = role  # in the error: "the <role> worker goes down with it"

    @property
    def tp_size(self) -> int:
        return len(self.processes) + 1

    broken: TPGroupError | None = None  # mark_broken's

    def mark_broken(self, error: BaseException) -> None:
        """The leader's collective failed (a follower hung or its connection closed): the
        group is no more, and ``watch`` takes the worker down as for an exited follower."""
        if self.broken is None:
            self.broken = TPGroupError(
                f"tensor-parallel group of {self.tp_size} broken ({error}); the {self.role} "
                "worker goes down with it"
            )

    def first_exited(self) -> TPGroupError | None:
        if self.broken is not None:
            return self.broken
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                return TPGroupError(
                    f"tensor-parallel rank {rank} of {self.tp_size} exited (code "
                    f"{proc.exitcode}); the {self.role} worker goes down with it"
                )
        return None

    async def watch(self, interval_s: float = 1.0) -> None:
        """Return never; raise ``TPGroupError`` once a follower has exited or the leader's
        collectives failed (``mark_broken``)."""
        while True:
            error = self.first_exited()
            if error is not None:
                raise error
            await asyncio.sleep(interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """After the leader closed the group: wait for the followers to end, kill stragglers."""
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()


def spawn_ranks(
    target: Callable[..., None],
    args: Callable[[int, list[int]], tuple[Any, ...]],
    tp: int,
    worker_id: str,
    role: str,
) -> RankProcesses:
    """Start ranks 1..tp-1 as ``target(*args(rank, cpus))``, ``cpus`` the rank's share of this
    process's CPUs, and pin this process (rank 0) to its own share."""
    ctx = mp.get_context("spawn")
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), tp)
    processes = [
        ctx.Process(
            target=target,
            args=args(rank, shares[rank]),
            name=f"{worker_id}-rank{rank}",
            daemon=True,
        )
        for rank in range(1, tp)
    ]
    for proc in processes:
        proc.start()
    os.sched_setaffinity(0, shares[0])  # after the spawns, which inherit the whole set
    return RankProcesses(processes, role)


def rank_device(device: str, rank: int) -> str:
    """The device rank ``rank`` of a worker on ``device`` runs on: the CPU for every rank of a
    CPU worker; one GPU each for a CUDA worker, counting from its own (``cuda:2`` at TP2: ranks
    on ``cuda:2`` and ``cuda:3``; ``cuda``: from 0)."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def group_backend(device: str) -> str:
    """torch.distributed's backend for ranks on ``device``: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def join_group(
    rank: int,
    tp_size: int,
    port: int,
    device: str = "cpu",
    collective_timeout_s: float = TP_COLLECTIVE_TIMEOUT_S,
) -> None:
    """Meet the other ranks in the default group on 127.0.0.1:``port``: gloo on the CPU, NCCL
    between GPUs, ``device`` this rank's own (``rank_device``). Waits up to TP_INIT_TIMEOUT_S
    for them; each collective after that up to ``collective_timeout_s``."""
    import datetime

    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)
    dist.init_process_group(
        group_backend(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=tp_size,
        timeout=datetime.timedelta(seconds=TP_INIT_TIMEOUT_S),
    )
    # torch has no public setter; _set_pg_timeout is in every torch this project takes (>= 2.4)
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=collective_timeout_s))


def become_follower(leader_pid: int, cpus: list[int]) -> None:
    """Set up a follower rank's process: on its ``cpus``, logging as the services do, ending
    when its leader closes the group or is gone (``exit_with_leader``), not on the signals a
    launcher sends the whole process group (the leader stops it once it drained)."""
    from kvmesh.shared.obs import logs

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.sched_setaffinity(0, cpus)
    exit_with_leader(leader_pid)
    logs.setup_logging()


def exit_with_leader(leader_pid: int) -> None:
    """Exit this process once the leader is gone (its parent changes)."""

    def watch() -> None:
        while os.getppid() == leader_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="leader-watch", daemon=True).start()


def whole_kv_spec(engine: Any) -> str:
    """A TP worker's ``kv_spec``: the whole model's KV layout, as a TP1 worker's (its peers
    compare it; each rank's pool holds only its share of the heads)."""
    from kvmesh.shared.model.identity import kv_spec_fingerprint

    mc = engine.model.config
    spec = dataclasses.replace(engine.kv_pool.spec, num_kv_heads=mc.num_key_value_heads)
    return kv_spec_fingerprint(spec, mc)


def adopt_whole_layout(engine: Any) -> None:
    """Have a rank's engine name the whole model's KV layout (``whole_kv_spec``) and root its
    prefix hash chains in it, as a TP1 worker's do: the registry, which hashes a prompt from
    the worker's advertised layout, then finds the worker's cached prefixes. Call on every rank
    (their chains must stay the same) before the first request."""
    from kvmesh.shared.kv.prefix_hash import layout_root

    engine.kv_spec = whole_kv_spec(engine)
    engine.block_manager.root_hash = layout_root(engine.kv_spec)
