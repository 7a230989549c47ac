"""A tensor-parallel prefill worker's ranks: ``kvmesh serve prefill --tp N`` (docs/tp.md).

The process that serves is rank 0, the leader: it alone talks to NATS, takes jobs and announces
them, as any prefill worker. ``start_tp_group`` spawns ranks 1..N-1 (``follower_main``), joins
them in a gloo group over 127.0.0.1, shards the leader's model and wraps its engine in a
``LeaderEngine``; each follower loads the model, keeps its shard and replays the leader's engine
calls, writing its own heads of every chunk to the decode worker (``PrefillFollower``).

Each rank runs on its share of the worker's CPUs and threads (``shared/engine/tp_ranks.py``:
equal runs when the worker has at least one CPU a rank, else all of them shared). The ranks live and die together: a follower whose leader is gone exits (its next collective
fails, and a watcher checks the parent every second); the leader's ``watch`` raises as soon as a
follower exits, which takes the worker down (its leases then fail as for any dead worker, and
the launcher restarts it).

``TPWrites`` is what the leader's worker needs to write its own share: its rank slice for the
chunk planner, the ``HandOff`` note that tells followers where a job's KV goes, and
``RankReports``: the followers' word on each job's writes (relayed by ``TPGroup.relay``), which
the worker awaits before it announces the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import queue
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from kvmesh.services.prefill.kv_writes import RankSlice, job_rank_slices, rank_block_slices
from kvmesh.services.prefill.tp_follower import DecodeTarget, HandOff, RankReport
from kvmesh.shared.config.ports import held_port
from kvmesh.shared.engine.tp_ranks import (
    RankProcesses,
    become_follower,
    join_group,
    rank_device,
    rank_threads,
    spawn_ranks,
    whole_kv_spec,
)
from kvmesh.shared.kv.head_shards import KVHeadShards
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.prefill.config import PrefillConfig
    from kvmesh.shared.bus.messages.prefill_jobs import PrefillJob
    from kvmesh.shared.kv.kv_cache import KVCacheSpec

log = logs.get_logger(__name__)

# how long the leader waits for its followers' word on a job once its own writes landed
TP_REPORT_TIMEOUT_S = 30.0


class RankReports:
    """The leader's record of what its followers said about each job in hand (``RankReport``):
    a job is done once every follower reported it done, failed at the first error."""

    def __init__(self, num_followers: int) -> None:
        self.num_followers = num_followers
        self._jobs: dict[str, tuple[set[int], list[str], asyncio.Event]] = {}

    def expect(self, request_id: str) -> None:
        """Keep the followers' reports of ``request_id`` (others are dropped: jobs ended)."""
        self._jobs[request_id] = (set(), [], asyncio.Event())

    def on_report(self, report: RankReport) -> None:
        entry = self._jobs.get(report.request_id)
        if entry is None:
            return
        done, errors, event = entry
        if report.error:
            errors.append(report.error)
            event.set()
            return
        done.add(report.rank)
        if len(done) == self.num_followers:
            event.set()

    async def wait(self, request_id: str, timeout_s: float) -> str:
        """ "" once every follower's writes of the job landed; else why not (a follower's error,
        or none heard from some within ``timeout_s``). Forgets the job."""
        done, errors, event = self._jobs[request_id]
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            missing = sorted(set(range(1, self.num_followers + 1)) - done)
            return f"no word on the KV writes of tensor-parallel ranks {missing} in {timeout_s} s"
        finally:
            self.forget(request_id)
        return errors[0] if errors else ""

    def forget(self, request_id: str) -> None:
        self._jobs.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class TPWrites:
    """The leader's share of every job's writes (``rank_slices``), and its followers'
    reports."""

    spec: KVCacheSpec  # the leader's KV pool: its share of the heads
    num_kv_heads: int  # the whole model's
    tp_size: int
    reports: RankReports
    report_timeout_s: float = TP_REPORT_TIMEOUT_S

    @staticmethod
    def for_leader(
        spec: KVCacheSpec, num_kv_heads: int, tp_size: int, reports: RankReports
    ) -> TPWrites:
        rank_block_slices(
            spec, KVHeadShards(num_kv_heads, tp_size), KVHeadShards(num_kv_heads, 1), 0
        )
        return TPWrites(spec, num_kv_heads, tp_size, reports)

    def rank_slices(self, decode_tp: int) -> list[RankSlice]:
        """What the leader writes of every block into a decode worker at TP ``decode_tp``, one
        ``RankSlice`` per decode rank it writes to (decode rank 0 first: it holds head 0)."""
        return job_rank_slices(self.spec, self.num_kv_heads, self.tp_size, decode_tp)

    @staticmethod
    def kv_spec(engine: Any) -> str:
        """The worker's ``kv_spec``: the whole model's KV layout, as a TP1 worker's (decode
        workers compare it; each rank's pool holds only its share of the heads)."""
        return whole_kv_spec(engine)

    @staticmethod
    def note(msg: PrefillJob) -> HandOff:
        """What the followers need of a job to write their heads of it: every decode rank's
        blocks (rank 0's in the job's own fields, the others' in ``msg.ranks``)."""
        descriptor = msgspec.json.encode(msg.descriptor)
        targets = [DecodeTarget(descriptor, msg.rkey, tuple(msg.block_addrs), msg.block_bytes)]
        for rank in msg.ranks:
            rank_descriptor = msgspec.json.encode(rank.descriptor)
            targets.append(
                DecodeTarget(
                    rank_descriptor,
                    rank.rkey,
                    tuple(rank.block_addrs),
                    rank.block_bytes or msg.block_bytes,
                )
            )
        return HandOff(tuple(targets))


class TPGroup:
    """The leader's side: the follower processes, the group, the followers' reports."""

    def __init__(self, ranks: RankProcesses, reports: Any) -> None:
        self.ranks = ranks
        self._reports = reports  # a multiprocessing queue of RankReport

    @property
    def processes(self) -> list[Any]:
        return self.ranks.processes

    async def relay(self, into: RankReports, poll_s: float = 0.5) -> None:
        """Hand the followers' reports to ``into`` as they come; returns never."""
        while True:
            report = await asyncio.to_thread(self._next_report, poll_s)
            if report is not None:
                into.on_report(report)

    def _next_report(self, timeout_s: float) -> RankReport | None:
        try:
            return self._reports.get(timeout=timeout_s)
        except queue.Empty:
            return None

    @property
    def tp_size(self) -> int:
        return self.ranks.tp_size

    async def watch(self, interval_s: float = 1.0) -> None:
        """Return never; raise ``TPGroupError`` once a follower has exited."""
        await self.ranks.watch(interval_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """After ``LeaderEngine.close``: wait for the followers to end, kill the stragglers."""
        self.ranks.stop(timeout_s)


def start_tp_group(config: PrefillConfig, worker_id: str) -> tuple[TPGroup, socket.socket]:
    """Spawn ranks 1..tp-1 for ``config``; returns them and the port the group meets on, held
    (``held_port``) until the caller has joined as rank 0 (``join_group``) and closes it."""
    import torch

    meeting = held_port()
    port = meeting.getsockname()[1]
    reports = mp.get_context("spawn").Queue()
    threads = rank_threads(config.threads, len(os.sched_getaffinity(0)), config.tp)
    rank_config = dataclasses.replace(config, threads=threads)
    ranks = spawn_ranks(
        follower_main,
        lambda rank, cpus: (rank_config, worker_id, rank, port, os.getpid(), cpus, reports),
        config.tp,
        worker_id,
        "prefill",
    )
    torch.set_num_threads(threads)  # the leader's share too
    return TPGroup(ranks, reports), meeting


def follower_main(
    config: PrefillConfig,
    worker_id: str,
    rank: int,
    port: int,
    leader_pid: int,
    cpus: list[int],
    reports: Any,
) -> None:
    """A follower rank's process (``become_follower``), until its leader closes the group."""
    become_follower(leader_pid, cpus)
    asyncio.run(_follow(config, worker_id, rank, port, reports))


async def _follow(
    config: PrefillConfig, worker_id: str, rank: int, port: int, reports: Any
) -> None:
    import torch
    from kvmesh.services.prefill.tp_follower import PrefillFollower
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.config import parse_dtype
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.tensor_parallel import shard_model
    from kvmesh.shared.transport import TransportConfig, create_transport

    if config.threads is not None:  # its share of the worker's (start_tp_group)
        torch.set_num_threads(config.threads)
    config = dataclasses.replace(config, device=rank_device(config.device, rank))  # its own GPU
    dtype = parse_dtype(config.dtype, "--dtype") if config.dtype else None
    model, tokenizer = await asyncio.to_thread(load_model, config.model, dtype, config.device)
    await asyncio.to_thread(join_group, rank, config.tp, port, config.device)
    shard_model(model)
    econf = config.engine_config(dtype, config.kv_cache_bytes, config.num_blocks)
    engine = LLMEngine(model, tokenizer, econf)
    bind_host, advertise_host = config.transport_hosts()
    tconf = TransportConfig(
        peer_id=f"{worker_id}.rank{rank}", tcp_host=bind_host, tcp_advertise_host=advertise_host
    )
    async with create_transport(config.transport, tconf) as transport:
        region = transport.register(engine.kv_pool.raw)
        follower = PrefillFollower(
            engine, None, transport, region, model.config.num_key_value_heads, reports.put
        )
        log.info("tp follower ready", worker_id=worker_id, rank=rank, tp=config.tp)
        stats = await follower.run()
        log.info("tp follower done", rank=rank, writes=stats.num_writes, failed=stats.num_failed)
