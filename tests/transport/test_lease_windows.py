"""Lease-scoped write authority through a real decode worker on real transports: each
reservation's window admits its own writer's bytes and immediates and nothing else, and closes
with the lease (the attacks of the security issue: writes into unleased blocks, into another
lease, after expiry; forged immediates, also from another lease's holder on shm, tcp and rdma;
forged PrefillDone)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest
from kvmesh.services.decode.pending import PendingTable
from kvmesh.services.decode.windows import LeaseWindows
from kvmesh.services.decode.worker import DecodeWorker
from kvmesh.shared.bus.messages.placement import ReserveReply, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone, PrefillJob, PrefillStarted
from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.engine.llm_engine import LLMEngine
from kvmesh.shared.kv.imm import imm_slot, pack_imm
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.transport import (
    Access,
    MemoryWindow,
    RefusalReason,
    RemoteAccessError,
    TransportConfig,
    WriteEntry,
    create_transport,
)
from support.prefill_rig import ready_advert
from support.transport_wire import over_the_wire

NUM_BLOCKS = 32


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
        self.ep = await self.tx.connect(over_the_wire(public))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ep.aclose()
        await self.tx.aclose()
        await self.rx.aclose()

    async def reserve(self, rid: str, num_tokens: int = 20) -> ReserveReply:
        opts = SamplingOptions(max_tokens=4, temperature=0.0)
        req = ReserveRequest(rid, tuple(range(1, num_tokens + 1)), opts, False, "L" + rid, 1000)
        reply = await self.worker.reserve(req)
        assert reply.ok, reply.error
        return reply

    def slot(self, reply: ReserveReply) -> int:
        return imm_slot(self.region.addr + reply.block_ids[0] * self.block_bytes, self.block_bytes)

    async def write(self, block: int, rkey: int, imm: int) -> None:
        addr = self.region.addr + block * self.block_bytes
        entry = WriteEntry(self.src_region, 0, addr, rkey, self.block_bytes)
        await asyncio.wait_for(self.ep.write([entry], imm), 10)

    async def deliver(self) -> None:
        """Hand every completion so far to the worker (the service's completion loop)."""
        while (c := self.rx.completion_queue.get_nowait()) is not None:
            self.worker.on_completion(c)

    def block_bytes_of(self, block: int) -> bytes:
        raw = self.engine.kv_pool.raw
        return bytes(raw[block * self.block_bytes : (block + 1) * self.block_bytes][:16])


def _done(reply: ReserveReply, rid: str, num_writes: int, rkey: int) -> Any:
    return PrefillDone(rid, "L" + rid, True, first_token=5, num_writes=num_writes, rkey=rkey)


async def test_each_lease_gets_its_own_key_and_the_region_key_is_not_advertised(tiny) -> None:
    async with Mesh(tiny) as m:
        a, b = await m.reserve("a"), await m.reserve("b")
        assert len({a.rkey, b.rkey, m.region.rkey}) == 3
        public = m.rx.descriptor().public()
        assert public.regions == () and str(m.region.rkey).encode() not in msgspec.json.encode(
            public
        )
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
            assert info.value.reason == RefusalReason.REFUSED
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
        assert info.value.reason == RefusalReason.REFUSED


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


# ---- the pending table's check of an immediate's writer, without transports ------------------


def _table_with_window(writer: str = "") -> PendingTable:
    table = PendingTable()
    window = MemoryWindow(0xABC, 1, ((4096, 4096),), Access.REMOTE_WRITE)
    table.add("r", "Lr", 5, (1,), deadline=10.0, window=window)
    if writer:
        assert table.on_started("r", "Lr", writer)
    return table


def test_immediate_counts_when_its_keys_hold_the_leases_window() -> None:
    table = _table_with_window()
    assert table.on_immediate(5, 0, frozenset({7, 0xABC}), "anyone") is None
    assert table.get("r").num_writes == 1 and table.num_stray_immediates == 0


def test_immediate_without_the_leases_key_is_stray_and_leaves_the_lease_alone() -> None:
    table = _table_with_window(writer="p0")
    assert table.on_immediate(5, 0, frozenset({7}), "p0") is None  # its name does not help
    assert table.on_immediate(5, 0, frozenset(), "p0") is None
    assert table.get("r").num_writes == 0 and table.num_stray_immediates == 2


def test_immediate_the_transport_cannot_vouch_for_must_come_from_the_announced_writer() -> None:
    table = _table_with_window(writer="p0")
    assert table.on_immediate(5, 0, None, "p1") is None
    assert table.get("r").num_writes == 0 and table.num_stray_immediates == 1
    assert table.on_immediate(5, 0, None, "p0") is None
    assert table.get("r").num_writes == 1


def test_immediate_the_transport_cannot_vouch_for_counts_before_the_writer_is_known() -> None:
    table = _table_with_window()  # its PrefillStarted has not arrived yet
    assert table.on_immediate(5, 0, None, "p1") is None
    assert table.get("r").num_writes == 1


def test_stray_immediates_are_logged_sampled_with_the_victims_request_id() -> None:
    from structlog.testing import capture_logs

    table = _table_with_window()
    with capture_logs() as logged:
        for _ in range(10):
            table.on_immediate(5, 0, frozenset(), "forger")
    refused = [e for e in logged if e["event"] == "immediate refused"]
    assert [e["stray_immediates_total"] for e in refused] == [1, 10]
    assert refused[0]["request_id"] == "r" and refused[0]["peer"] == "forger"


# ---- immediates count only from the lease holder's connection, on every backend --------------
# The victim's writer is a real prefill worker; the attacker holds a live lease of its own, on a
# connection of its own, and names the victim's slot in immediates written into its own blocks.

BACKENDS = ["shm", "tcp", "rdma", "rdma-without-windows"]
PROMPT = tuple((7 * i) % 250 + 1 for i in range(40))  # 3 blocks, prefilled in chunks of 16


def _transport(backend: str, verbs: Any, peer_id: str):
    from kvmesh.shared.transport.rdma import RdmaTransport

    if backend.startswith("rdma"):
        extra = {"rdma_memory_windows": backend == "rdma"}
        return RdmaTransport(TransportConfig(peer_id=peer_id, extra=extra), verbs=verbs)
    return create_transport(backend, TransportConfig(peer_id=peer_id))


def _reference_tokens(tiny: Any, max_tokens: int) -> list[int]:
    """What one engine generates for PROMPT, greedy, with no hand-off."""
    from kvmesh.shared.text.sampling import SamplingOptions

    engine = LLMEngine(*tiny, EngineConfig(num_blocks=16))
    engine.add_request("ref", list(PROMPT), SamplingOptions(max_tokens=max_tokens, temperature=0))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


class ForgeryMesh:
    """A decode worker on ``backend``; a prefill worker (the victim's writer) and an attacker,
    each on a transport and connection of its own."""

    def __init__(self, tiny: Any, backend: str) -> None:
        self.tiny = tiny
        self.backend = backend

    async def __aenter__(self) -> ForgeryMesh:
        from kvmesh.services.prefill.worker import PrefillWorker
        from kvmesh.shared.transport.endpoint_cache import EndpointCache
        from support.fake_pyverbs import FakeVerbs

        self._stack = contextlib.AsyncExitStack()
        await self._stack.__aenter__()
        verbs = FakeVerbs()  # one fabric for every rdma transport
        enter = self._stack.enter_async_context
        self.rx = await enter(_transport(self.backend, verbs, "d0"))
        tx = await enter(_transport(self.backend, verbs, "p-victim"))
        self.ax = await enter(_transport(self.backend, verbs, "p-attacker"))
        endpoints = await enter(EndpointCache(tx))
        mc = self.tiny[0].config
        spec = KVCacheSpec(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, 16)
        self.block_bytes = bb = spec.block_bytes
        engine = LLMEngine(
            *self.tiny,
            EngineConfig(num_blocks=NUM_BLOCKS),
            kv_buffer=self.rx.allocate(NUM_BLOCKS * bb),
        )
        self.region = self.rx.register(engine.kv_pool.raw, Access.REMOTE_WRITE)
        windows = LeaseWindows(self.rx, self.region, bb)
        self.worker = DecodeWorker(
            engine, worker_id="d0", base_addr=self.region.addr, windows=windows
        )
        public = self.rx.descriptor().public()
        penv = LLMEngine(*self.tiny, EngineConfig(num_blocks=64, max_num_batched_tokens=16))
        self.prefill = PrefillWorker(
            penv, tx.register(penv.kv_pool.raw), endpoints, worker_id="p-victim", kv_spec="s"
        )
        self.descriptor = over_the_wire(public)  # as the prefill worker hears it
        self.prefill.adverts.note(ready_advert(self.descriptor, self.region, spec, "s"))
        self._loop = asyncio.create_task(self.prefill.run())
        self._stack.push_async_callback(self._stop_prefill)
        self.src = self.ax.allocate(bb)
        self.src.fill_(0x66)
        self.src_region = self.ax.register(self.src)
        self.attacker = await self.ax.connect(over_the_wire(public))
        self._stack.push_async_callback(self.attacker.aclose)
        return self

    async def _stop_prefill(self) -> None:
        self._loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._loop

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.__aexit__(*exc)

    async def reserve(self, rid: str, prompt: tuple[int, ...]) -> ReserveReply:
        opts = SamplingOptions(max_tokens=4, temperature=0.0)
        req = ReserveRequest(rid, prompt, opts, False, "L" + rid, 60_000)
        reply = await self.worker.reserve(req)
        assert reply.ok, reply.error
        return reply

    def slot(self, reply: ReserveReply) -> int:
        return imm_slot(self.region.addr + reply.block_ids[0] * self.block_bytes, self.block_bytes)

    async def deliver(self, n: int) -> None:
        """Hand the next ``n`` completions to the worker (the service's completion loop)."""
        for _ in range(n):
            self.worker.on_completion(await asyncio.wait_for(self.rx.completion_queue.get(), 10))

    async def forge(self, own: ReserveReply, imm: int) -> None:
        """The attacker writes its own leased block, with an immediate of its choosing."""
        addr = self.region.addr + own.block_ids[0] * self.block_bytes
        entry = WriteEntry(self.src_region, 0, addr, own.rkey, self.block_bytes)
        await asyncio.wait_for(self.attacker.write([entry], imm), 10)

    def job(self, rid: str, reply: ReserveReply) -> PrefillJob:
        addrs = tuple(self.region.addr + b * self.block_bytes for b in reply.block_ids)
        return PrefillJob(
            rid,
            PROMPT,
            SamplingOptions(max_tokens=4, temperature=0.0),
            "d0",
            "L" + rid,
            self.descriptor,
            reply.rkey,
            addrs,
            self.block_bytes,
            enqueued_at=0.0,
        )

    async def tokens_of(self, rid: str) -> list[int]:
        """Run the decode engine until idle; the tokens it streamed for ``rid``."""
        events = []
        for _ in range(1000):
            if self.worker.is_idle:
                break
            events += await self.worker.admit()
            events += await self.worker.step()
        assert all(e.finish_reason != "error" for e in events), events
        return [t for e in events if e.request_id == rid for t in e.token_ids]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_forged_immediates_from_another_lease_holder_are_refused_and_the_victim_completes(
    tiny, backend: str
) -> None:
    async with ForgeryMesh(tiny, backend) as m:
        victim, attacker = await m.reserve("v", PROMPT), await m.reserve("x", (1, 2, 3))
        m.worker.on_prefill_started(PrefillStarted("v", "Lv", "p-victim"))
        for chunk in range(3):  # every chunk the victim's writer is about to write
            await m.forge(attacker, pack_imm(m.slot(victim), chunk))
        await m.deliver(3)
        assert m.worker.pending.num_stray_immediates == 3
        assert m.worker.pending.get("v").num_writes == 0
        result = await m.prefill.prefill(m.job("v", victim))
        assert result is not None and result.done.ok and result.done.num_writes == 3
        await m.deliver(result.done.num_writes)
        m.worker.on_prefill_done(result.done)
        assert "v" not in m.worker.pending  # admitted, not failed by "arrived twice"
        tokens = await m.tokens_of("v")  # the prefill's first token, then the decode steps'
        assert tokens[0] == result.done.first_token
        assert tokens == _reference_tokens(tiny, max_tokens=4)
        assert m.worker.pending.num_stray_immediates == 3
