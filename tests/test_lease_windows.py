"""Lease-scoped write authority through a real decode worker on a real tcp transport: each
reservation's window admits its own writer's bytes and immediates and nothing else, and closes
with the lease (the attacks of the security issue: writes into unleased blocks, into another
lease, after expiry; forged immediates; forged PrefillDone)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared import protocol
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.kv_cache import KVCacheSpec
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.imm import imm_slot, pack_imm
from kvmesh.shared.transport import (
    Access,
    PeerDescriptor,
    RefusalReason,
    RemoteAccessError,
    TransportConfig,
    WriteEntry,
    create_transport,
)

NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def tiny():
    from kvmesh.shared.model.loader import load_model

    return load_model("kvmesh-tiny")


class Mesh:
    """A decode worker whose pool is a tcp region, and one writer process-side endpoint."""

    def __init__(self, tiny: Any) -> None:
        self.tiny = tiny
        self.now = [100.0]

    async def __aenter__(self) -> Mesh:
        self.rx = await create_transport("tcp", TransportConfig()).__aenter__()
        self.tx = await create_transport("tcp", TransportConfig()).__aenter__()
        econf = EngineConfig(num_blocks=NUM_BLOCKS)
        mc = self.tiny[0].config
        spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, 16)
        bb = spec.block_bytes
        buffer = self.rx.allocate(NUM_BLOCKS * bb)
        self.engine = LLMEngine(*self.tiny, econf, kv_buffer=buffer)
        assert self.engine.kv_pool.spec.block_bytes == bb
        self.region = self.rx.register(self.engine.kv_pool.raw, Access.REMOTE_WRITE)
        self.block_bytes = bb

        self.worker = DecodeWorker(
            self.engine,
            worker_id="d0",
            base_addr=self.region.addr,
            windows=LeaseWindows(self.rx, self.region, bb),
            clock=lambda: self.now[0],
        )
        self.src = self.tx.allocate(bb)
        self.src.fill_(0x77)
        self.src_region = self.tx.register(self.src)
        public = self.rx.descriptor().public()
        self.ep = await self.tx.connect(PeerDescriptor.from_dict(public.to_dict()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ep.aclose()
        await self.tx.aclose()
        await self.rx.aclose()

    async def reserve(self, rid: str, num_tokens: int = 20) -> protocol.ReserveReply:
        opts = protocol.SamplingOptions(max_tokens=4, temperature=0.0)
        req = protocol.ReserveRequest(
            rid, tuple(range(1, num_tokens + 1)), opts, False, "L" + rid, 1000
        )
        reply = await self.worker.reserve(req)
        assert reply.ok, reply.error
        return reply

    def slot(self, reply: protocol.ReserveReply) -> int:
        return imm_slot(self.region.addr + reply.block_ids[0] * self.block_bytes, self.block_bytes)

    async def write(self, block: int, rkey: int, imm: int) -> None:
        addr = self.region.addr + block * self.block_bytes
        entry = WriteEntry(self.src_region, 0, addr, rkey, self.block_bytes)
        await asyncio.wait_for(self.ep.write([entry], imm), 10)

    async def deliver(self) -> None:
        """Hand every completion so far to the worker (the service's completion loop)."""
        while (c := self.rx.completion_queue.get_nowait()) is not None:
            self.worker.on_completion(c.imm, c.rkey)

    def block_bytes_of(self, block: int) -> bytes:
        raw = self.engine.kv_pool.raw
        return bytes(raw[block * self.block_bytes : (block + 1) * self.block_bytes][:16])


def _done(reply: protocol.ReserveReply, rid: str, num_writes: int, rkey: int) -> Any:
    return protocol.PrefillDone(
        rid, "L" + rid, True, first_token=5, num_writes=num_writes, rkey=rkey
    )


async def test_each_lease_gets_its_own_key_and_the_region_key_is_not_advertised(tiny) -> None:
    async with Mesh(tiny) as m:
        a, b = await m.reserve("a"), await m.reserve("b")
        assert len({a.rkey, b.rkey, m.region.rkey}) == 3
        public = m.rx.descriptor().public().to_dict()
        assert public["regions"] == [] and str(m.region.rkey) not in repr(public)
        with pytest.raises(RemoteAccessError):  # the region's key is not a writer's key
            await m.write(a.block_ids[0], m.region.rkey ^ 0x5555, pack_imm(m.slot(a), 0))


async def test_writes_outside_the_own_lease_are_refused_and_leave_the_blocks_alone(tiny) -> None:
    async with Mesh(tiny) as m:
        a, b = await m.reserve("a"), await m.reserve("b")
        leased = set(a.block_ids) | set(b.block_ids)
        free = next(i for i in range(NUM_BLOCKS) if i not in leased)
        before = {blk: m.block_bytes_of(blk) for blk in (free, *b.block_ids)}
        for block in (free, b.block_ids[0]):  # an unleased block; another lease's block
            with pytest.raises(RemoteAccessError) as info:
                await m.write(block, a.rkey, pack_imm(m.slot(a), 0))
            assert info.value.reason == RefusalReason.OUT_OF_BOUNDS
        assert {blk: m.block_bytes_of(blk) for blk in before} == before
        await m.write(a.block_ids[0], a.rkey, pack_imm(m.slot(a), 0))
        assert m.block_bytes_of(a.block_ids[0]) == b"\x77" * 16
        assert m.rx.stats().refused == 2


async def test_write_after_the_lease_expired_is_refused(tiny) -> None:
    async with Mesh(tiny) as m:
        a = await m.reserve("a")
        m.now[0] += 2.0  # past the 1 s lease
        assert len(m.worker.expire_leases()) == 1
        with pytest.raises(RemoteAccessError) as info:
            await m.write(a.block_ids[0], a.rkey, pack_imm(m.slot(a), 0))
        assert info.value.reason == RefusalReason.DEREGISTERED


async def test_forged_immediate_with_another_lease_key_does_not_touch_the_victim(tiny) -> None:
    async with Mesh(tiny) as m:
        victim, attacker = await m.reserve("v"), await m.reserve("x")
        # The attacker holds a real key (its own lease) and names the victim's slot and chunk.
        await m.write(attacker.block_ids[0], attacker.rkey, pack_imm(m.slot(victim), 0))
        await m.deliver()
        assert m.worker.pending.num_stray_immediates == 1
        assert m.worker.pending.get("v").num_writes == 0
        # The victim's own writer then writes chunk 0: no "arrived twice".
        await m.write(victim.block_ids[0], victim.rkey, pack_imm(m.slot(victim), 0))
        await m.deliver()
        assert m.worker.pending.get("v").num_writes == 1


async def test_forged_prefill_done_without_the_lease_key_is_ignored(tiny) -> None:
    async with Mesh(tiny) as m:
        a = await m.reserve("a")
        await m.write(a.block_ids[0], a.rkey, pack_imm(m.slot(a), 0))
        await m.deliver()
        m.worker.on_prefill_done(_done(a, "a", num_writes=1, rkey=0))
        m.worker.on_prefill_done(_done(a, "a", num_writes=1, rkey=a.rkey ^ 1))
        assert m.worker.pending.num_forged_announcements == 2
        assert m.worker.pending.get("a").done is None
        m.worker.on_prefill_done(_done(a, "a", num_writes=1, rkey=a.rkey))
        assert "a" not in m.worker.pending  # admitted: its window is closed now
        with pytest.raises(RemoteAccessError):
            await m.write(a.block_ids[0], a.rkey, pack_imm(m.slot(a), 1))
