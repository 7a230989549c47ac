"""A tensor-parallel decode worker's leases (services/decode/tp_leases.py, docs/tp.md): each
reservation a window on every rank, every rank's writes counted before the sequence is admitted.

In one process over real tcp transports (no NATS, no rank processes): a TP1 prefill worker
writes a prompt into a "TP2 decode worker" made of the leader's ``GroupWindows`` and pending
table and a follower's ``RankLeases`` (its answers handed back at once, as its process would);
each rank gets exactly its half of every block, and the lease completes only with both ranks'
writes in. The pure parts: duplicates, strays, quarantine, windows that do not open; the
configs of ``--tp`` and ``kvmesh up --decode-tp``."""

from __future__ import annotations

import asyncio
import queue
from typing import Any

import pytest
from kvmesh.services.decode.tp_leases import (
    CloseWindow,
    GroupPendingTable,
    GroupWindows,
    OpenWindow,
    RankLeases,
    RankWrite,
)
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.kv.imm import imm_slot, unpack_imm
from kvmesh.shared.transport.base import Access, MemoryRegion, MemoryWindow
from support.prefill_rig import prefill_rig, tp2_job

PROMPT = list(range(3, 67))  # 64 tokens: 4 whole blocks of 16, chunks of 32 at most
BLOCKS = [4, 9, 2, 6]


class Inline:
    """A follower's control queue whose follower answers at once (into ``replies``)."""

    def __init__(self, leases: RankLeases | None, replies: queue.Queue) -> None:
        self.leases = leases
        self.replies = replies
        self.sent: list[Any] = []

    def put(self, msg: OpenWindow | CloseWindow) -> None:
        self.sent.append(msg)
        reply = self.leases.on_control(msg) if self.leases is not None else None
        if reply is not None:
            self.replies.put(reply)


async def _take(transport: Any, n: int) -> list[Any]:
    async def take() -> list[Any]:
        out = []
        async for completion in transport.completions():
            out.append(completion)
            if len(out) == n:
                return out
        return out

    return await asyncio.wait_for(take(), 60)


async def test_a_lease_completes_once_every_rank_has_its_heads_of_every_chunk(tiny) -> None:
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.transport import TransportConfig, create_transport

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=32, max_num_batched_tokens=32))
    spec = engine.kv_pool.spec
    half = spec.block_bytes // 2  # each decode rank holds one of kvmesh-tiny's 2 KV heads
    async with (
        prefill_rig(engine, kv_spec="s", remote_blocks=16) as (worker, side, _, _),
        create_transport("tcp", TransportConfig(peer_id="d1.rank1")) as rank1,
    ):
        pools = [t.allocate(16 * half) for t in (side, rank1)]
        regions = [
            t.register(p, Access.REMOTE_WRITE) for t, p in zip((side, rank1), pools, strict=True)
        ]
        for pool in pools:
            pool.zero_()
        leases = RankLeases(1, rank1, regions[1], half)
        replies: queue.Queue = queue.Queue()
        control = Inline(leases, replies)
        windows = GroupWindows(
            side, regions[0], half, [control], replies, [rank1.descriptor().public()]
        )
        table = windows.pending_table(30.0)
        assert isinstance(table, GroupPendingTable) and table.tp_size == 2

        window = windows.open(BLOCKS)  # the reservation
        (target,) = windows.ranks(window)
        assert target.block_addrs == tuple(regions[1].addr + b * half for b in BLOCKS)
        slot = imm_slot(regions[0].addr + BLOCKS[0] * half, half)
        table.add("tp", "Ltp", slot, tuple(BLOCKS), deadline=1e12, window=window)

        to_rank1 = (target.rkey, target.block_addrs, target.descriptor)
        addrs = [regions[0].addr + b * half for b in BLOCKS]
        job = tp2_job(worker, side, regions[0], spec, PROMPT, window.rkey, addrs, to_rank1)
        result = await worker.prefill(job)
        assert result is not None and result.done.ok, result
        n = result.done.num_writes  # one rank's: a write a chunk, several chunks
        assert n > 1
        mine, theirs = await _take(side, n), await _take(rank1, n)

        assert table.on_done(result.done) is None  # the announcement first: writes to come
        for c in mine:
            assert table.on_immediate(*unpack_imm(c.imm), c.keys, c.peer_id) is None
        writes = [leases.on_completion(c) for c in theirs]
        assert all(isinstance(w, RankWrite) for w in writes)
        verdicts = [table.on_rank_write(1, windows.leader_key(1, w.rkey), w.write) for w in writes]
        assert verdicts[:-1] == [None] * (n - 1)  # not before the follower's last write
        assert verdicts[-1] is not None and verdicts[-1].ok, verdicts[-1]

        # each rank got exactly its head of every block of the lease, nothing else
        for completions in (mine, theirs):
            assert sum(c.num_bytes for c in completions) == len(BLOCKS) * half
        assert sum(w.num_bytes for w in writes) == len(BLOCKS) * half == leases.num_bytes
        for pool in pools:
            assert all(bool(pool[b * half : (b + 1) * half].any()) for b in BLOCKS)
            others = [b for b in range(16) if b not in BLOCKS]
            assert not any(bool(pool[b * half : (b + 1) * half].any()) for b in others)

        windows.close(window)  # the lease ended: every rank's window closes
        assert len(leases) == 0 and windows.ranks(window) == ()
        assert windows.leader_key(1, target.rkey) is None
        assert isinstance(control.sent[-1], CloseWindow)
        assert table.on_rank_write(1, None, 0) is None  # a late one: stray
        assert table.num_stray_immediates == 1


def _window(rkey: int) -> MemoryWindow:
    return MemoryWindow(rkey, 1, ((0, 64),), Access.REMOTE_WRITE)


def _done(num_writes: int, ok: bool = True) -> PrefillDone:
    return PrefillDone("r", "L", ok, first_token=5, num_writes=num_writes, rkey=7)


def test_a_followers_write_counted_twice_fails_the_lease() -> None:
    table = GroupPendingTable(30.0, tp_size=2)
    table.add("r", "L", 3, (3,), deadline=100.0, window=_window(7))
    assert table.on_rank_write(1, 7, 0) is None
    verdict = table.on_rank_write(1, 7, 0)
    assert verdict is not None and not verdict.ok
    assert verdict.error == "KV write 0 arrived twice at rank 1"
    assert "r" not in table


def test_an_expired_lease_stays_quarantined_until_every_ranks_writes_landed() -> None:
    table = GroupPendingTable(30.0, tp_size=2)
    table.add("r", "L", 3, (3,), deadline=10.0, window=_window(7))
    assert table.on_immediate(3, 0, frozenset({7})) is None  # the leader's one write
    (expired,) = table.expire(now=11.0)
    assert not expired.ok and not expired.release  # quarantined: rank 1's may still land
    assert table.on_done(_done(1)) is None  # announced: one write on each rank
    verdict = table.on_rank_write(1, 7, 0)  # rank 1's lands: the blocks go back now
    assert verdict is not None and not verdict.ok and verdict.release and not verdict.notify


def test_a_reservation_is_refused_when_a_rank_cannot_open_its_window() -> None:
    from kvmesh.services.decode.tp_leases import WindowOpened

    class Closes:
        def __init__(self) -> None:
            self.closed: list[MemoryWindow] = []

        def open_window(self, region, spans, access) -> MemoryWindow:
            return _window(11)

        def close_window(self, window: MemoryWindow) -> None:
            self.closed.append(window)

    region = _region()
    silent = Inline(None, queue.Queue())
    transport = Closes()
    windows = GroupWindows(transport, region, 64, [silent], silent.replies, ["d"], 0.05)
    with pytest.raises(ValueError, match=r"tensor-parallel ranks \[1\] did not open"):
        windows.open([0, 1])
    assert transport.closed == [_window(11)]  # the leader's own closed again

    replies: queue.Queue = queue.Queue()
    replies.put(WindowOpened(1, 1, error="cannot open a write window: table full"))
    windows = GroupWindows(transport, region, 64, [Inline(None, replies)], replies, ["d"])
    with pytest.raises(ValueError, match="tensor-parallel rank 1: cannot open a write window"):
        windows.open([0])

    # an uneven split (3 KV heads at TP2): rank 1's blocks are half rank 0's; the target says so
    # (0: rank 0's size, as every rank of an even split)
    for rank_bytes, said in ((32, 32), (64, 0)):
        replies = queue.Queue()
        replies.put(WindowOpened(1, 1, 5, (8192,), block_bytes=rank_bytes))
        windows = GroupWindows(transport, region, 64, [Inline(None, replies)], replies, ["d"])
        (target,) = windows.ranks(windows.open([0]))
        assert target.block_bytes == said


def _region() -> MemoryRegion:
    return MemoryRegion(addr=4096, length=4096, rkey=1, access=Access.REMOTE_WRITE)


def test_tp_configs_refuse_what_a_tp_decode_worker_cannot_run_and_up_passes_tp() -> None:
    from kvmesh.services.decode.config import DecodeConfig

    from kvmesh.commands.serve import build_service_config
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_plan import plan

    assert DecodeConfig(tp=2).tp == 2
    assert DecodeConfig(tp=2, mode="colocated").tp == 2
    with pytest.raises(ValueError, match="--tp 2 needs no --speculative"):
        DecodeConfig(tp=2, speculative=True)
    with pytest.raises(ValueError, match="--decode-tp > 1 needs no --draft"):
        UpConfig(decode_tp=2, draft="ngram")
    specs = plan(UpConfig(decode_tp=2), "nats://127.0.0.1:4222", 8000)
    (decode,) = [s for s in specs if s.name == "decode-0"]
    _, config, _ = build_service_config("decode", decode.argv[2:], env={})
    assert config.tp == 2  # kvmesh serve decode --tp 2
    (prefill,) = [s for s in specs if s.name == "prefill-0"]
    assert "--tp" not in prefill.argv
    specs = plan(UpConfig(mode="colocated", decode_tp=2), "nats://127.0.0.1:4222", 8000)
    (colocated,) = [s for s in specs if s.name == "colocated-0"]
    _, config, _ = build_service_config("colocated", colocated.argv[2:], env={})
    assert (config.mode, config.tp) == ("colocated", 2)  # kvmesh serve colocated --tp 2


def test_up_refuses_at_start_what_tp_workers_would_refuse_or_ignore_later() -> None:
    """A KV dtype conversion (every job would be refused) and kv-stores no worker would use
    (every worker tensor-parallel): refused at ``kvmesh up``, saying what to change. A TP1
    side keeps the kv-store in use, and one KV dtype on both sides is TP's own (int8 tested in
    tests/model/test_tensor_parallel.py)."""
    from kvmesh.commands.up_config import UpConfig

    for tp in ({"prefill_tp": 2}, {"decode_tp": 2}):
        with pytest.raises(ValueError, match="give both the same KV cache dtype"):
            UpConfig(**tp, decode_kv_cache_dtype="int8")
        assert UpConfig(**tp, kv_cache_dtype="int8", decode_kv_cache_dtype="int8").kv_store == 0
        assert UpConfig(**tp, kv_store=1).kv_store == 1  # the TP1 side uses it
    for all_tp in ({"prefill_tp": 2, "decode_tp": 2}, {"mode": "colocated", "decode_tp": 2}):
        with pytest.raises(ValueError, match="--kv-store 1 would serve no worker"):
            UpConfig(**all_tp, kv_store=1)
