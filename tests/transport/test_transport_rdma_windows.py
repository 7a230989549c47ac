"""Lease-scoped writes on rdma, against tests/support/fake_pyverbs.py: a window's key resolves into verbs
memory windows bound to exactly its spans on the writer's own connection; the NIC refuses
everything else (blocks outside, the region's key, another connection's window, a closed
window), the receiver counts it; a NIC without memory windows falls back to region keys and says
so. The hardware-marked test at the end runs wherever an RDMA device exists."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import socket

import pytest
import torch
from kvmesh.shared.transport.base import Access, WriteEntry
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import PeerGoneError, RefusalReason, RemoteAccessError
from kvmesh.shared.transport.rdma import RdmaTransport, rdma_available
from kvmesh.shared.transport.rdma_mw_bind import choose_window_type
from support.fake_pyverbs import FakeDevice, FakeVerbs, e
from support.transport_windows import BLOCK, PoolPair

NUM_BLOCKS = 16


class Mesh(PoolPair):
    """A receiver with a pool of NUM_BLOCKS blocks and a writer connected to it, on one fake
    fabric."""

    def __init__(self, verbs: FakeVerbs, **extra: object) -> None:
        self.verbs = verbs
        rx = RdmaTransport(TransportConfig(peer_id="decode", extra=extra), verbs=verbs)
        tx = RdmaTransport(TransportConfig(peer_id="prefill"), verbs=verbs)
        super().__init__(rx, tx, NUM_BLOCKS)

    async def used_window(self, block: int):
        """A window over ``block`` that a write went through (bound on the NIC), the write's
        completion taken and the pool zeroed again."""
        window = self.window(block)
        await self.write(block, window.rkey)
        await self.completions(1)
        self.mem.zero_()
        return window

    def accepted_qpn(self, ep=None) -> int:
        """The receiver's QP of the connection ``ep`` (default: the mesh's endpoint)."""
        return (ep or self.ep)._entry.qp.attrs["dest_qp_num"]

    async def post_raw(self, ep, rkey: int, addr: int, length: int, imm: int | None = 9) -> int:
        """What a forger does: post a WR of its own making, skipping the endpoint's checks.
        Returns the completion status the writer sees."""
        v = self.verbs
        opcode = e.IBV_WR_RDMA_WRITE if imm is None else e.IBV_WR_RDMA_WRITE_WITH_IMM
        sge = v.SGE(self.src_region.addr, length, self.src_region.lkey)
        wr = v.SendWR(wr_id=77, opcode=opcode, num_sge=1, sg=[sge], imm_data=socket.htonl(imm or 0))
        wr.set_wr_rdma(rkey=rkey, addr=addr)
        qp = ep._entry.qp
        qp.post_send(wr)
        [(_, _, _, status)] = [
            ev for ev in v.fabric.events("send_status") if ev[1] == qp.qp_num and ev[2] == 77
        ]
        return status


async def _no_completion(rx: RdmaTransport) -> None:
    await asyncio.sleep(0.05)
    assert rx.completion_queue.qsize() == 0


# -- capability -------------------------------------------------------------------------------------


def test_window_type_prefers_type_2_then_type_1_then_none():
    def kind(*types: int) -> int:
        return choose_window_type(FakeVerbs(), FakeDevice(mw_types=types))

    assert kind(e.IBV_MW_TYPE_1, e.IBV_MW_TYPE_2) == e.IBV_MW_TYPE_2
    assert kind(e.IBV_MW_TYPE_1) == e.IBV_MW_TYPE_1
    assert kind() == 0


# -- binding ----------------------------------------------------------------------------------------


async def test_window_key_resolves_to_a_type_2_window_bound_on_the_writers_connection():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        assert m.rx.memory_windows == e.IBV_MW_TYPE_2
        window = m.window(3)
        assert window.enforced and window.rkey != m.region.rkey
        assert verbs.fabric.events("alloc_mw") == []  # nothing bound before a writer asks
        await m.write(3, window.rkey, imm=41)
        done = await asyncio.wait_for(m.rx.completion_queue.get(), 2)
        assert done.imm == 41 and m.written() == [3]
        [bind_chain] = [c for _, q, c in verbs.fabric.events("post_send") if q == m.accepted_qpn()]
        [bind] = bind_chain
        assert bind["opcode"] == e.IBV_WR_BIND_MW and bind["send_flags"] == e.IBV_SEND_SIGNALED
        assert bind["bind"] == {
            "addr": m.addr(3),
            "length": BLOCK,
            "access": e.IBV_ACCESS_REMOTE_WRITE,
        }
        [mw] = verbs.fabric.mws.values()
        assert mw.type == e.IBV_MW_TYPE_2 and mw.qp.qp_num == m.accepted_qpn()
        [(_, _, [write])] = [ev for ev in verbs.fabric.events("post_send") if ev[1] == m.ep.qp_num]
        assert write["rkey"] == mw.hw_rkey == bind["rkey"]


async def test_window_of_several_spans_binds_one_window_per_merged_span():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        window = m.window(2, 3, 9, 12)  # spans: [2, 3], [9], [12]
        for block in (3, 9, 12, 2):
            await m.write(block, window.rkey)
        assert m.written() == [2, 3, 9, 12]
        spans = sorted((mw.addr, mw.length) for mw in verbs.fabric.mws.values())
        assert spans == [(m.addr(2), 2 * BLOCK), (m.addr(9), BLOCK), (m.addr(12), BLOCK)]
        assert len({mw.hw_rkey for mw in verbs.fabric.mws.values()}) == 3


async def test_window_on_a_type_1_device_is_bound_with_the_bind_verb():
    verbs = FakeVerbs(FakeDevice(mw_types=(e.IBV_MW_TYPE_1,)))
    async with Mesh(verbs) as m:
        assert m.rx.memory_windows == e.IBV_MW_TYPE_1
        window = m.window(5, 7)
        await m.write(7, window.rkey)
        assert m.written() == [7]
        binds = verbs.fabric.events("bind_mw")
        assert [b[1] for b in binds] == [m.accepted_qpn()] * 2
        assert [b[2]["send_flags"] for b in binds] == [0, e.IBV_SEND_SIGNALED]  # last signaled
        assert all(mw.type == e.IBV_MW_TYPE_1 for mw in verbs.fabric.mws.values())


async def test_region_is_registered_for_window_binding_without_remote_access_of_its_own():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        pool = next(ev for ev in verbs.fabric.events("reg_mr") if ev[1]["length"] == m.mem.numel())
        assert pool[1]["access"] == (
            e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND | e.IBV_ACCESS_RELAXED_ORDERING
        )
        desc = m.rx.descriptor()
        assert desc.backend("rdma").memory_windows == e.IBV_MW_TYPE_2
        assert desc.public().regions == ()  # the region key is never advertised
        assert desc.backend("rdma").iova == {}


# -- refusals ---------------------------------------------------------------------------------------


async def test_window_write_outside_its_blocks_is_refused_before_the_nic():
    async with Mesh(FakeVerbs()) as m:
        mine, other = m.window(2), m.window(5)
        for block in (1, 3, 5):  # unleased blocks, and another lease's block
            with pytest.raises(RemoteAccessError) as info:
                await m.write(block, mine.rkey)
            assert info.value.reason == RefusalReason.REFUSED
        await m.write(5, other.rkey)  # the connection survives a refusal made here
        assert m.written() == [5]


async def test_forged_write_outside_a_bound_window_is_refused_by_the_nic_and_counted():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        await m.used_window(2)
        [mw] = verbs.fabric.mws.values()
        before = m.rx.stats().refused
        status = await m.post_raw(m.ep, mw.hw_rkey, m.addr(3), BLOCK)
        assert status == e.IBV_WC_REM_ACCESS_ERR
        assert await m.refused_after(before + 1) == before + 1
        assert m.written() == []
        await _no_completion(m.rx)
        assert ("qp_error", m.accepted_qpn()) in verbs.fabric.log  # class C: responder QP errs


async def test_write_with_the_regions_own_key_is_refused_and_counted():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        m.window(0)
        before = m.rx.stats().refused
        with pytest.raises(RemoteAccessError) as info:  # asked for as a window: refused
            await m.write(0, m.region.rkey)
        assert info.value.reason == RefusalReason.REFUSED
        assert "region" not in str(info.value)  # said alike for any key: the log says why
        assert m.rx.stats().refused == before + 1
        mr_key = m.rx.memory.registration(m.region).mr.rkey  # the NIC's key, should it leak
        assert await m.post_raw(m.ep, mr_key, m.addr(0), BLOCK) == e.IBV_WC_REM_ACCESS_ERR
        assert await m.refused_after(before + 2) == before + 2
        assert m.written() == []


async def test_type_2_window_is_refused_through_another_connection():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        window = m.window(4)
        await m.write(4, window.rkey)  # bound on the first connection
        m.mem.zero_()
        [mw] = verbs.fabric.mws.values()
        other = await m.connect()
        before = m.rx.stats().refused
        assert await m.post_raw(other, mw.hw_rkey, m.addr(4), BLOCK) == e.IBV_WC_REM_ACCESS_ERR
        assert await m.refused_after(before + 1) == before + 1
        assert m.written() == []
        await m.write(4, window.rkey)  # the first connection still writes
        assert m.written() == [4]


async def test_window_closed_after_use_is_refused_by_the_nic_and_counted():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        window = await m.used_window(6)
        m.rx.close_window(window)
        m.rx.close_window(window)  # closing twice is harmless
        assert verbs.fabric.mws == {}  # deallocated: invalid on the NIC at once
        before = m.rx.stats().refused
        with pytest.raises(RemoteAccessError) as info:  # the writer's cached key is dead
            await m.write(6, window.rkey, imm=99)
        assert "IBV_WC_REM_ACCESS_ERR" in str(info.value)
        assert await m.refused_after(before + 1) == before + 1
        await _no_completion(m.rx)  # its immediate was refused with it
        assert m.written() == []
        with pytest.raises(PeerGoneError):  # RC: the refused connection is gone
            await m.write(6, window.rkey)
        fresh = await m.connect()  # a writer that resolves only now learns it was closed
        with pytest.raises(RemoteAccessError) as info:
            await m.write(6, window.rkey, ep=fresh)
        assert info.value.reason == RefusalReason.REFUSED


async def test_guessed_window_keys_are_refused_counted_and_keep_the_connection():
    async with Mesh(FakeVerbs()) as m:
        window = m.window(0)
        before = m.rx.stats().refused
        for guess in (window.rkey + 1, window.rkey ^ 0x8000_0000, 12345):
            with pytest.raises(RemoteAccessError) as info:
                await m.write(0, guess)
            assert info.value.reason == RefusalReason.REFUSED
        assert m.rx.stats().refused == before + 3
        await m.write(0, window.rkey)
        assert m.written() == [0]


async def test_zero_length_immediate_without_a_key_is_refused_not_completed():
    """A zero-length write is checked against no key (IBTA C9-88): the receiver refuses its
    immediate itself, since kvmesh never sends one."""
    async with Mesh(FakeVerbs()) as m:
        before = m.rx.stats().refused
        assert await m.post_raw(m.ep, 0xDEAD, 0, 0, imm=123) == e.IBV_WC_SUCCESS
        assert await m.refused_after(before + 1) == before + 1
        await _no_completion(m.rx)


# -- whose immediate: the connection's windows -----------------------------------------------------


async def _keys_of_next_completion(rx: RdmaTransport) -> frozenset[int] | None:
    return (await asyncio.wait_for(rx.completion_queue.get(), 2)).keys


async def test_immediate_carries_the_window_keys_of_its_own_connection_only():
    """An immediate arrives without the key its write used; what the receiver can vouch for is
    the connection it came on, and that connection's windows (which only it can use, type 2)."""
    async with Mesh(FakeVerbs()) as m:
        mine, theirs = m.window(1), m.window(2)
        other = await m.connect()
        await m.write(1, mine.rkey)
        assert await _keys_of_next_completion(m.rx) == {mine.rkey}
        await m.write(2, theirs.rkey, ep=other)
        assert await _keys_of_next_completion(m.rx) == {theirs.rkey}
        await m.write(1, mine.rkey)  # the other connection's window is not this one's
        assert await _keys_of_next_completion(m.rx) == {mine.rkey}


async def test_immediate_names_every_window_its_connection_resolved_until_one_closes():
    async with Mesh(FakeVerbs()) as m:
        first, second = m.window(3), m.window(4)
        await m.write(3, first.rkey)
        assert await _keys_of_next_completion(m.rx) == {first.rkey}
        await m.write(4, second.rkey)
        assert await _keys_of_next_completion(m.rx) == {first.rkey, second.rkey}
        m.rx.close_window(first)
        await m.write(4, second.rkey)
        assert await _keys_of_next_completion(m.rx) == {second.rkey}


async def test_immediate_on_a_type_1_device_names_its_connections_windows_too():
    async with Mesh(FakeVerbs(FakeDevice(mw_types=(e.IBV_MW_TYPE_1,)))) as m:
        window = m.window(5)
        await m.write(5, window.rkey)
        assert await _keys_of_next_completion(m.rx) == {window.rkey}


async def test_type_1_window_used_from_another_connection_vouches_for_none_of_its_immediates():
    """A type-1 MW binds to no QP: a forger that knows its NIC key writes through it from a
    connection of its own; the bytes land, but the immediate names no window of that connection."""
    verbs = FakeVerbs(FakeDevice(mw_types=(e.IBV_MW_TYPE_1,)))
    async with Mesh(verbs) as m:
        window = m.window(5)
        await m.write(5, window.rkey)
        await _keys_of_next_completion(m.rx)
        [mw] = verbs.fabric.mws.values()
        forger = await m.connect()
        assert await m.post_raw(forger, mw.hw_rkey, m.addr(5), BLOCK) == e.IBV_WC_SUCCESS
        assert await _keys_of_next_completion(m.rx) == frozenset()


async def test_immediate_without_memory_windows_cannot_say_whose_it_is():
    async with Mesh(FakeVerbs(), rdma_memory_windows=False) as m:
        await m.write(6, m.window(6).rkey)
        assert await _keys_of_next_completion(m.rx) is None


async def test_deregistering_the_region_closes_its_windows_first():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        window = m.window(1)
        await m.write(1, window.rkey)
        m.rx.deregister(m.region)  # the fake, like rxe, refuses to deregister an MR with MWs
        assert verbs.fabric.mws == {}
        with pytest.raises(RemoteAccessError):
            await m.write(1, window.rkey)


async def test_closing_the_connection_deallocates_its_windows_and_keeps_the_lease():
    verbs = FakeVerbs()
    async with Mesh(verbs) as m:
        window = m.window(8)
        await m.write(8, window.rkey)
        await m.ep.aclose()
        for _ in range(100):
            if not verbs.fabric.mws:
                break
            await asyncio.sleep(0.01)
        assert verbs.fabric.mws == {}
        m.mem.zero_()
        await m.write(8, window.rkey, ep=await m.connect())  # a new writer binds afresh
        assert m.written() == [8]


async def test_bind_failure_is_a_clear_error_for_the_writer():
    async with Mesh(FakeVerbs(FakeDevice(max_mw=1))) as m:
        window = m.window(1, 3)  # two spans, one memory window left on the device
        with pytest.raises(PeerGoneError, match="out of memory windows"):
            await m.write(1, window.rkey)
        assert m.rx.windows.num_mws == 0  # the one it got was given back


async def test_window_over_dmabuf_memory_is_bound_and_written_at_its_iova():
    verbs = FakeVerbs()
    backing = mmap.mmap(-1, 4 * BLOCK)
    pool = torch.frombuffer(backing, dtype=torch.uint8)  # stands in for GPU memory
    base = pool.data_ptr()

    def export(ptr: int, length: int) -> tuple[int, int]:
        fd = os.open(os.devnull, os.O_RDONLY)
        verbs.fabric.dmabufs[fd] = base
        return fd, ptr - base

    async with (
        RdmaTransport(TransportConfig(peer_id="gpu"), verbs=verbs, dmabuf_exporter=export) as rx,
        RdmaTransport(TransportConfig(peer_id="prefill"), verbs=verbs) as tx,
    ):
        region = rx.memory.register_dmabuf(pool[BLOCK:], Access.REMOTE_WRITE)  # iova = BLOCK
        window = rx.open_window(region, [(region.addr + 2 * BLOCK, BLOCK)])
        assert window.enforced and rx.descriptor().backend("rdma").iova == {}
        src = torch.full((BLOCK,), 7, dtype=torch.uint8)
        src_region = tx.register(src)
        ep = await tx.connect(rx.descriptor())
        await ep.write([WriteEntry(src_region, 0, region.addr + 2 * BLOCK, window.rkey, BLOCK)], 5)
        [mw] = verbs.fabric.mws.values()
        assert (mw.addr, mw.length) == (3 * BLOCK, BLOCK)  # bound in the MR's iova space
        [[write]] = [c for _, q, c in verbs.fabric.events("post_send") if q == ep.qp_num]
        assert (write["remote_addr"], write["rkey"]) == (3 * BLOCK, mw.hw_rkey)
        assert bool((pool[3 * BLOCK :] == 7).all()) and not pool[: 3 * BLOCK].any()
        rx.close_window(window)
        assert verbs.fabric.mws == {}
    del pool


# -- fallback ---------------------------------------------------------------------------------------


async def test_device_without_memory_windows_scopes_writes_to_the_region_and_says_so(caplog):
    verbs = FakeVerbs(FakeDevice(mw_types=()))
    with caplog.at_level(logging.WARNING, logger="kvmesh.shared.transport.rdma_windows"):
        async with Mesh(verbs) as m:
            window = m.window(2)
            assert not window.enforced and window.rkey == m.region.rkey
            assert m.rx.descriptor().backend("rdma").memory_windows == 0
            assert m.rx.descriptor().public().regions == (m.region,)
            await m.write(9, window.rkey)  # the NIC checks the region's bounds only
            assert m.written() == [9]
            m.rx.close_window(window)
            await m.write(10, window.rkey)
            assert m.written() == [9, 10]
    warnings = [r.getMessage() for r in caplog.records if "no memory windows" in r.getMessage()]
    assert len(warnings) == 2  # once per transport, at start-up
    assert "scoped to the registered region, not to a lease" in warnings[0]


async def test_memory_windows_can_be_turned_off():
    async with Mesh(FakeVerbs(), rdma_memory_windows=False) as m:
        assert m.rx.memory_windows == 0 and not m.window(1).enforced


# -- fidelity of the fake ---------------------------------------------------------------------------


def test_fake_enums_match_real_pyverbs():
    real = pytest.importorskip("pyverbs.enums", reason="pyverbs not installed")
    names = [n for n in vars(e) if n.startswith("IBV_")]
    assert names and {n: int(getattr(real, n)) for n in names} == {n: getattr(e, n) for n in names}


def test_real_pyverbs_has_the_memory_window_api():
    pytest.importorskip("pyverbs.mr", reason="pyverbs not installed")
    from kvmesh.shared.transport.rdma_device import load_pyverbs

    v = load_pyverbs()
    wr = v.SendWR(wr_id=3, opcode=v.e.IBV_WR_BIND_MW, send_flags=v.e.IBV_SEND_SIGNALED)
    assert callable(wr.set_bind_wr) and hasattr(wr, "rkey")
    assert callable(v.QP.bind_mw) and hasattr(v.MW, "rkey")
    with pytest.raises(TypeError, match="4 positional"):
        v.MWBindInfo()  # (mr, addr, length, mw_access_flags)


# -- real device ------------------------------------------------------------------------------------


@pytest.mark.rdma
async def test_real_window_write_lands_and_a_closed_window_is_refused():
    ok, why = rdma_available()
    if not ok:
        pytest.skip(why)
    async with contextlib.AsyncExitStack() as stack:
        rx = await stack.enter_async_context(RdmaTransport(TransportConfig(peer_id="decode")))
        tx = await stack.enter_async_context(RdmaTransport(TransportConfig(peer_id="prefill")))
        if not rx.memory_windows:
            pytest.skip(f"RDMA device {rx.device.name} binds no memory windows")
        mem = rx.allocate(4 * BLOCK)
        mem.zero_()
        region = rx.register(mem, Access.REMOTE_WRITE)
        src = torch.full((BLOCK,), 7, dtype=torch.uint8)
        src_region = tx.register(src)
        ep = await tx.connect(rx.descriptor())
        window = rx.open_window(region, [(region.addr + BLOCK, BLOCK)])
        await ep.write([WriteEntry(src_region, 0, region.addr + BLOCK, window.rkey, BLOCK)], 5)
        assert (await asyncio.wait_for(rx.completion_queue.get(), 5)).imm == 5
        assert bool((mem[BLOCK : 2 * BLOCK] == 7).all()) and not mem[:BLOCK].any()
        rx.close_window(window)
        with pytest.raises(RemoteAccessError):
            await ep.write([WriteEntry(src_region, 0, region.addr + BLOCK, window.rkey, BLOCK)], 6)
