"""A tensor-parallel decode worker's ranks: ``kvmesh serve decode --tp N`` (docs/tp.md).

The process that serves is rank 0, the leader: the only rank on NATS, with the worker's
scheduler, sampling, adverts and leases, as any decode worker. ``DecodeRanks.start`` spawns
ranks 1..N-1 (``follower_main``) with the prefill group's machinery
(``shared/engine/tp_ranks.py``: each on its share of the worker's CPUs and threads), meets them
in one gloo group, shards the leader's model, and waits until every follower has registered its
pool; ``lead`` wraps the leader's engine in a ``LeaderEngine``, whose every state-changing call
each follower replays on its own engine (SPMD: the same blocks, batches and tokens on every
rank; each rank's pool holds its KV heads).

Each lease is a window on every rank (``tp_leases.py``): the leader's ``GroupWindows`` has each
follower open one over the reservation's blocks and puts their keys and addresses in the
``ReserveReply``; each follower checks the writes that land in its pool and tells the leader of
each (``RankWrite``, relayed by ``relay`` into the ``GroupPendingTable``), which admits the
sequence only once every rank's writes of every chunk have landed.

The ranks live and die together: the leader's ``watch`` raises once a follower exits (the
worker goes down, its leases fail as any dead worker's, requests migrate as today); a follower
exits once its leader closes the group (``close``) or is gone (its next collective fails, and a
watcher checks its parent every second), never holding a window for a lease nobody keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
from kvmesh.services.decode.tp_leases import (
    GroupWindows,
    RankLeases,
    RankReady,
    RankWrite,
)
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.shared.bus.worker_feature import Feature, Features, Loop, Site
from kvmesh.shared.config.ports import held_port
from kvmesh.shared.engine.tp_ranks import (
    TP_INIT_TIMEOUT_S,
    RankProcesses,
    TPGroupError,
    adopt_whole_layout,
    become_follower,
    join_group,
    rank_device,
    rank_threads,
    spawn_ranks,
)
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.obs import logs

if TYPE_CHECKING:
    from kvmesh.services.decode.config import DecodeConfig
    from kvmesh.services.decode.worker import DecodeWorker
    from kvmesh.shared.transport.base import MemoryRegion, Transport

log = logs.get_logger(__name__)


def tp_config(config: DecodeConfig) -> DecodeConfig:
    """What a TP decode worker runs with: no kv-store (its puts, swaps and prefix reads are one
    pool's), the rest as asked (``DecodeConfig`` refuses what it cannot run)."""
    if config.tp > 1 and config.use_kv_store:
        log.warning(
            "the kv-store is off at --tp > 1: finished requests' KV is not kept for later "
            "turns and preempted sequences are recomputed (--no-use-kv-store says so)",
            tp=config.tp,
        )
        return dataclasses.replace(config, use_kv_store=False)
    return config


def lease_windows(
    ranks: DecodeRanks | None,
    transport: Transport | None,
    region: MemoryRegion | None,
    block_bytes: int,
) -> LeaseWindows | None:
    """A decode worker's lease windows: on every rank of ``ranks``, else on its one pool (None
    without a data plane: colocated)."""
    if transport is None or region is None:
        return None
    if ranks is None:
        return LeaseWindows(transport, region, block_bytes)
    return ranks.make_windows(transport, region, block_bytes)


def with_ranks(features: Features, ranks: DecodeRanks | None) -> Features:
    """The worker's features, its rank group last (closed first, once the worker stopped)."""
    return features if ranks is None else Features([*features, ranks])


@dataclass(frozen=True, slots=True)
class RankChannels:
    """A follower's queues: ``control`` from the leader (OpenWindow, CloseWindow), and the
    shared ``replies`` (RankReady, WindowOpened) and ``writes`` (RankWrite) to it."""

    control: Any
    replies: Any
    writes: Any


class DecodeRanks(Feature):
    """The leader's side of the group: the follower processes and their queues. A feature of
    the worker (shared/bus/worker_feature.py): its loops watch the followers and count their
    writes, its advert says ``tp``, and it closes the group after the worker stopped."""

    def __init__(self, ranks: RankProcesses, channels: list[RankChannels], seed: int) -> None:
        self.ranks = ranks
        self.channels = channels
        self.seed = seed  # every rank's sampler's: unseeded requests sample alike on each
        # ready(): followers' transports (None colocated: no data plane)
        self.descriptors: list[TransportDescriptor | None] = []
        self.windows: GroupWindows | None = None  # make_windows'
        self.worker: DecodeWorker | None = None  # serve(): whose leases the followers' writes fill
        self.engine: Any = None  # lead()'s
        self.bytes_by_rank = [0] * len(channels)  # bytes of writes landed on ranks 1..N-1

    @property
    def tp_size(self) -> int:
        return self.ranks.tp_size

    @staticmethod
    async def start(config: DecodeConfig, worker_id: str, model: Any) -> DecodeRanks:
        """Spawn ranks 1..tp-1, meet them as rank 0, shard ``model`` (this rank's share), and
        return once every follower has registered its pool."""
        import torch
        from kvmesh.shared.model.tensor_parallel import shard_model

        ctx = mp.get_context("spawn")
        meeting = held_port()  # until rank 0's store binds it: no other pick takes it
        port = meeting.getsockname()[1]
        replies, writes = ctx.Queue(), ctx.Queue()
        channels = [RankChannels(ctx.Queue(), replies, writes) for _ in range(1, config.tp)]
        threads = rank_threads(config.threads, len(os.sched_getaffinity(0)), config.tp)
        rank_config = dataclasses.replace(config, threads=threads)
        seed = random.SystemRandom().getrandbits(63)
        ranks = spawn_ranks(
            follower_main,
            lambda rank, cpus: (
                rank_config,
                worker_id,
                rank,
                port,
                os.getpid(),
                cpus,
                channels[rank - 1],
                seed,
            ),
            config.tp,
            worker_id,
            "decode",
        )
        torch.set_num_threads(threads)  # the leader's share too
        group = DecodeRanks(ranks, channels, seed)
        try:
            with meeting:
                await asyncio.to_thread(join_group, 0, config.tp, port, config.device)
            shard_model(model)
            await asyncio.to_thread(group._wait_ready, TP_INIT_TIMEOUT_S)
        except BaseException:
            for proc in ranks.processes:
                proc.kill()
            raise
        return group

    def _wait_ready(self, timeout_s: float) -> None:
        ready: dict[int, TransportDescriptor | None] = {}
        while len(ready) < len(self.channels):
            try:
                msg = self.channels[0].replies.get(timeout=1.0)
            except queue.Empty:
                error = self.ranks.first_exited()
                if error is not None:
                    raise error from None
                timeout_s -= 1.0
                if timeout_s <= 0:
                    raise TPGroupError(
                        "tensor-parallel ranks did not register their pools"
                    ) from None
                continue
            if isinstance(msg, RankReady):  # colocated: no transport, no descriptor
                ready[msg.rank] = (
                    msgspec.json.decode(msg.descriptor, type=TransportDescriptor)
                    if msg.descriptor
                    else None
                )
        self.descriptors = [ready[r] for r in range(1, self.tp_size)]

    def lead(self, engine: Any) -> Any:
        """The leader's engine: ``engine``'s state-changing calls replayed on every rank; its
        ``kv_spec`` the whole model's, as a TP1 worker's (what the advert says)."""
        from kvmesh.shared.engine.tp_leader import LeaderEngine

        engine.sampler.generator.manual_seed(self.seed)
        adopt_whole_layout(engine)  # its kv_spec and prefix hashes: the whole model's
        self.engine = LeaderEngine(engine, on_broken=self.ranks.mark_broken)
        return self.engine

    def make_windows(
        self, transport: Transport, region: MemoryRegion, block_bytes: int
    ) -> GroupWindows:
        """The worker's lease windows, on every rank (``block_bytes``: the leader's block); their
        ``pending_table`` counts every rank's writes."""
        self.windows = GroupWindows(
            transport,
            region,
            block_bytes,
            [c.control for c in self.channels],
            self.channels[0].replies,
            [d for d in self.descriptors if d is not None],  # disagg: every follower's
        )
        return self.windows

    def serve(self, worker: DecodeWorker) -> DecodeRanks:
        """The followers' writes fill ``worker``'s leases (made over ``make_windows``')."""
        self.worker = worker
        return self

    # ---- the feature ------------------------------------------------------------------------

    def loops(self, site: Site) -> Sequence[Loop]:
        if self.windows is None:  # colocated: no data plane, no writes to count
            return (self.ranks.watch,)
        return (self.ranks.watch, self.relay)

    def advert(self) -> Mapping[str, Any]:
        return {"tp": self.tp_size}

    async def aclose(self) -> None:
        """Stop the followers (the worker stopped) and wait for them to end."""
        if self.engine is not None:
            self.engine.close()
        await asyncio.to_thread(self.ranks.stop)
        log.info("tp ranks stopped", bytes_by_rank=self.bytes_by_rank)

    async def relay(self, poll_s: float = 0.5) -> None:
        """Count the followers' writes as they land (the worker admits a sequence once every
        rank's are in); returns never."""
        windows, worker = self.windows, self.worker
        assert windows is not None and windows.table is not None and worker is not None
        writes = self.channels[0].writes
        while True:
            msg = await asyncio.to_thread(_next, writes, poll_s)
            if not isinstance(msg, RankWrite):
                continue
            self.bytes_by_rank[msg.rank - 1] += msg.num_bytes
            key = windows.leader_key(msg.rank, msg.rkey)
            worker.remote.on_verdict(windows.table.on_rank_write(msg.rank, key, msg.write))


def _next(q: Any, timeout_s: float) -> Any:
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        return None


def follower_main(
    config: DecodeConfig,
    worker_id: str,
    rank: int,
    port: int,
    leader_pid: int,
    cpus: list[int],
    channels: RankChannels,
    seed: int,
) -> None:
    """A follower rank's process (``become_follower``), until its leader closes the group."""
    become_follower(leader_pid, cpus)
    asyncio.run(_follow(config, worker_id, rank, port, channels, seed))


async def _follow(
    config: DecodeConfig,
    worker_id: str,
    rank: int,
    port: int,
    channels: RankChannels,
    seed: int,
) -> None:
    import torch
    from kvmesh.services.decode.compose import build_engine
    from kvmesh.shared.engine.tp_leader import follow
    from kvmesh.shared.model.config import parse_dtype
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.tensor_parallel import shard_model
    from kvmesh.shared.transport import Access, TransportConfig, create_transport

    if config.threads is not None:  # its share of the worker's (DecodeRanks.start)
        torch.set_num_threads(config.threads)
    config = dataclasses.replace(config, device=rank_device(config.device, rank))  # its own GPU
    dtype = parse_dtype(config.dtype, "--dtype") if config.dtype else None
    model, tokenizer = await asyncio.to_thread(load_model, config.model, dtype, config.device)
    await asyncio.to_thread(join_group, rank, config.tp, port, config.device)
    shard_model(model)

    def engine_over(transport: Any) -> Any:
        engine = build_engine(config, model, tokenizer, transport)  # as the leader's
        engine.sampler.generator.manual_seed(seed)  # the leader's (its unseeded requests' noise)
        adopt_whole_layout(engine)  # as the leader's engine
        return engine

    if not config.uses_data_plane:  # colocated: no writes come, the engine calls are all
        engine = engine_over(None)
        channels.replies.put(RankReady(rank, b""))
        log.info("tp follower ready", worker_id=worker_id, rank=rank, tp=config.tp)
        num_calls = await asyncio.to_thread(follow, engine)  # until the leader closes
        log.info("tp follower done", rank=rank, calls=num_calls)
        return
    bind_host, advertise_host = config.transport_hosts()
    tconf = TransportConfig(
        peer_id=f"{worker_id}.rank{rank}", tcp_host=bind_host, tcp_advertise_host=advertise_host
    )
    async with create_transport(config.transport, tconf) as transport:
        engine = engine_over(transport)
        region = transport.register(engine.kv_pool.raw, Access.REMOTE_WRITE)
        leases = RankLeases(rank, transport, region, engine.kv_pool.spec.block_bytes)
        descriptor = msgspec.json.encode(transport.descriptor().public())
        channels.replies.put(RankReady(rank, descriptor))
        log.info("tp follower ready", worker_id=worker_id, rank=rank, tp=config.tp)

        async def control() -> None:
            while True:
                msg = await asyncio.to_thread(_next, channels.control, 0.5)
                if msg is not None:
                    reply = leases.on_control(msg)
                    if reply is not None:
                        channels.replies.put(reply)

        async def completions() -> None:
            async for completion in transport.completions():
                write = leases.on_completion(completion)
                if write is not None:
                    channels.writes.put(write)

        tasks = [asyncio.create_task(control()), asyncio.create_task(completions())]
        try:
            num_calls = await asyncio.to_thread(follow, engine)  # until the leader closes
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        log.info(
            "tp follower done",
            rank=rank,
            calls=num_calls,
            bytes=leases.num_bytes,
            stray=leases.num_stray,
        )
