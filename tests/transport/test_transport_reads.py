"""One-sided reads on shm, tcp and rdma (on tests/support/fake_pyverbs.py), scoped like writes: a reader
pulls bytes of a remote registered region straight into its own registered memory, only through
a window the owner opened with REMOTE_READ; a read outside its spans, with a write-only key or
after the window closed is refused (and counted where the owner can see it), and nothing of the
owner's Python code above the transport runs (issue #14, the KV store's reads)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from kvmesh.shared.transport import (
    Access,
    MemoryWindow,
    RefusalReason,
    RemoteAccessError,
    Transport,
    TransportConfig,
    WriteEntry,
)
from support.fake_pyverbs import FakeVerbs, e
from support.transport_windows import BLOCK, PoolPair, make_transport

NUM_BLOCKS = 8
BACKENDS = ["shm", "tcp", "rdma"]
# Every refusal is REFUSED, whatever its cause (no key oracle; the NIC says no more either).


class Owner(PoolPair):
    """An owner of NUM_BLOCKS distinct blocks (REMOTE_READ | REMOTE_WRITE) and a reader connected
    to it; the reader's landing buffer starts zeroed."""

    def __init__(self, backend: str) -> None:
        self.verbs = FakeVerbs()  # one fabric for both ends (rdma only)
        owner, reader = (make_transport(backend, TransportConfig(), self.verbs) for _ in range(2))
        super().__init__(owner, reader, NUM_BLOCKS, Access.REMOTE)

    @property
    def owner(self) -> Transport:
        return self.rx

    @property
    def reader(self) -> Transport:
        return self.tx

    def setup(self) -> None:
        super().setup()
        for b in range(NUM_BLOCKS):
            self.mem[b * BLOCK : (b + 1) * BLOCK] = b + 1
        self.dst = self.reader.allocate(NUM_BLOCKS * BLOCK)
        self.dst.zero_()
        self.dst_region = self.reader.register(self.dst)

    def window(self, *blocks: int, access: Access = Access.REMOTE_READ) -> MemoryWindow:
        return super().window(*blocks, access=access)

    async def read(self, pairs: list[tuple[int, int]], rkey: int) -> None:
        """Read remote block ``src`` into local block ``dst`` for each ``(src, dst)``."""
        entries = [
            WriteEntry(self.dst_region, d * BLOCK, self.addr(s), rkey, BLOCK) for s, d in pairs
        ]
        await asyncio.wait_for(self.ep.read(entries), 10)

    def landed(self) -> dict[int, int]:
        """Local block -> the value it holds, for blocks that are no longer zero."""
        blocks = self.dst.view(NUM_BLOCKS, BLOCK)
        return {b: int(blocks[b, 0]) for b in range(NUM_BLOCKS) if bool(blocks[b].any())}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_read_through_a_window_lands_the_owners_bytes_and_no_completion(backend: str) -> None:
    async with Owner(backend) as o:
        window = o.window(1, 2, 6)
        await o.read([(6, 0), (1, 3), (2, 4)], window.rkey)  # scattered on both sides
        assert o.landed() == {0: 7, 3: 2, 4: 3}
        expected = torch.cat([o.mem[6 * BLOCK : 7 * BLOCK], o.mem[1 * BLOCK : 3 * BLOCK]])
        got = torch.cat([o.dst[0:BLOCK], o.dst[3 * BLOCK : 5 * BLOCK]])
        assert torch.equal(got, expected)
        assert o.owner.completion_queue.qsize() == 0  # a read tells the owner's code nothing
        if backend != "rdma":  # the owner's transport served it (the NIC serves rdma reads)
            for _ in range(1000):  # tcp's receiver thread counts each entry after sending it
                if o.owner.stats().read_bytes >= 3 * BLOCK:
                    break
                await asyncio.sleep(0.005)
            assert o.owner.stats().read_bytes == 3 * BLOCK


@pytest.mark.parametrize("backend", BACKENDS)
async def test_read_outside_its_window_is_refused_and_reads_nothing(backend: str) -> None:
    async with Owner(backend) as o:
        mine = o.window(2)
        o.window(5)  # another reader's
        for block in (1, 3, 5):  # blocks under no window, and another window's block
            with pytest.raises(RemoteAccessError) as info:
                await o.read([(block, 0)], mine.rkey)
            assert info.value.reason == RefusalReason.REFUSED
        assert o.landed() == {}
        # rdma's endpoint refuses these before the NIC, which would end the connection (RC);
        # the NIC's refusal of a forged post is counted (below)
        expected = 0 if backend == "rdma" else 3
        assert await o.refused_after(expected) == expected
        await o.read([(2, 7)], mine.rkey)  # the connection survives
        assert o.landed() == {7: 3}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_read_with_a_write_only_key_is_refused(backend: str) -> None:
    async with Owner(backend) as o:
        write_only = o.window(4, access=Access.REMOTE_WRITE)
        with pytest.raises(RemoteAccessError) as info:
            await o.read([(4, 0)], write_only.rkey)
        assert info.value.reason == RefusalReason.REFUSED
        assert o.landed() == {}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_write_with_a_read_only_key_is_refused_and_changes_nothing(backend: str) -> None:
    async with Owner(backend) as o:
        read_only = o.window(4)
        before = o.mem.clone()
        with pytest.raises(RemoteAccessError) as info:
            await o.write(4, read_only.rkey, imm=1)
        assert info.value.reason == RefusalReason.REFUSED
        assert torch.equal(o.mem, before)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_read_after_the_window_closed_is_refused_and_counted(backend: str) -> None:
    async with Owner(backend) as o:
        window = o.window(3)
        await o.read([(3, 0)], window.rkey)  # on rdma: resolved and bound before it closes
        o.dst.zero_()
        o.owner.close_window(window)
        with pytest.raises(RemoteAccessError) as info:
            await o.read([(3, 0)], window.rkey)
        assert info.value.reason == RefusalReason.REFUSED
        assert await o.refused_after(1) == 1
        assert o.landed() == {}


async def test_rdma_forged_read_outside_a_bound_window_is_refused_by_the_nic_and_counted() -> None:
    """A reader that skips its endpoint's checks and posts an RDMA READ with a bound window's
    NIC key at another block: the NIC refuses it, the owner's QP errs, the owner counts it."""
    async with Owner("rdma") as o:
        window = o.window(2)
        await o.read([(2, 0)], window.rkey)
        o.dst.zero_()
        [mw] = o.verbs.fabric.mws.values()
        v = o.verbs
        sge = v.SGE(o.dst_region.addr, BLOCK, o.dst_region.lkey)
        wr = v.SendWR(wr_id=88, opcode=e.IBV_WR_RDMA_READ, num_sge=1, sg=[sge])
        wr.set_wr_rdma(rkey=mw.hw_rkey, addr=o.addr(5))
        qp = o.ep._entry.qp
        qp.post_send(wr)
        [(_, _, _, status)] = [
            ev for ev in v.fabric.events("send_status") if ev[1] == qp.qp_num and ev[2] == 88
        ]
        assert status == e.IBV_WC_REM_ACCESS_ERR
        assert await o.refused_after(1) == 1
        assert o.landed() == {}
