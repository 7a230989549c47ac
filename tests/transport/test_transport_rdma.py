"""rdma backend: logic against tests/support/fake_pyverbs.py (a recording, byte-moving stand-in), plus a
real loopback write-with-imm wherever an RDMA device exists (SoftRoCE counts).

The fake device offers memory windows (types 1 and 2, like rxe) unless a test says otherwise, so
writes go through window keys; ``NO_MW`` is a device without them (region keys, the fallback).
Lease-window behaviour on rdma is in tests/transport/test_transport_rdma_windows.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import mmap
import os
import socket

import msgspec
import pytest
import torch
from kvmesh.shared.transport.base import Access, MemoryRegion, WriteEntry
from kvmesh.shared.transport.config import TransportConfig
from kvmesh.shared.transport.errors import (
    BackendUnavailableError,
    LocalAccessError,
    PeerGoneError,
    PeerUnreachableError,
    RefusalReason,
    RemoteAccessError,
)
from kvmesh.shared.transport.rdma import RdmaEndpoint, RdmaTransport, rdma_available
from kvmesh.shared.transport.rdma_qp import QPLimits, Span, build_segments, completion_error
from support.fake_pyverbs import FakeDevice, FakeVerbs, e

BLOCK = 4096
NO_MW = FakeDevice(mw_types=())


def _config(peer_id: str, **extra: int) -> TransportConfig:
    return TransportConfig(peer_id=peer_id, extra=extra)


@contextlib.asynccontextmanager
async def _pair(verbs: FakeVerbs, **extra: int):
    async with (
        RdmaTransport(_config("decode", **extra), verbs=verbs) as receiver,
        RdmaTransport(_config("prefill", **extra), verbs=verbs) as sender,
    ):
        yield receiver, sender


def _pools(receiver: RdmaTransport, sender: RdmaTransport, num_blocks: int = 8):
    """Returns ``dst_region`` as peers address it: with the key of a window over all of it
    (where the receiver binds memory windows) or the region itself."""
    dst = receiver.allocate(num_blocks * BLOCK)
    dst_region = receiver.register(dst, Access.REMOTE_WRITE | Access.REMOTE_READ)
    window = receiver.open_window(dst_region, [(dst_region.addr, dst_region.length)], Access.REMOTE)
    src = torch.randint(0, 256, (num_blocks * BLOCK,), dtype=torch.uint8)
    src_region = sender.register(src)
    return dst, msgspec.structs.replace(dst_region, rkey=window.rkey), src, src_region


@dataclasses.dataclass
class _Connected:
    """What ``_connected`` yields: the pair, the sender's endpoint and the pools."""

    receiver: RdmaTransport
    sender: RdmaTransport
    ep: RdmaEndpoint
    dst: torch.Tensor
    dst_region: MemoryRegion
    src: torch.Tensor
    src_region: MemoryRegion


@contextlib.asynccontextmanager
async def _connected(verbs: FakeVerbs, num_blocks: int = 8, **extra: int):
    """A pair (``_pair``) with its pools (``_pools``), the sender connected to the receiver."""
    async with _pair(verbs, **extra) as (receiver, sender):
        dst, dst_region, src, src_region = _pools(receiver, sender, num_blocks)
        ep = await sender.connect(receiver.descriptor())
        yield _Connected(receiver, sender, ep, dst, dst_region, src, src_region)


def _entries(src_region, dst_region, pairs):
    return [
        WriteEntry(src_region, s * BLOCK, dst_region.addr + d * BLOCK, dst_region.rkey, BLOCK)
        for s, d in pairs
    ]


def _sends(verbs: FakeVerbs, qpn: int) -> list[list[dict]]:
    """The WR chains posted on QP ``qpn`` (the receiver posts its binds on its own QPs)."""
    return [chain for _, q, chain in verbs.fabric.events("post_send") if q == qpn]


def _mw_rkeys(verbs: FakeVerbs) -> set[int]:
    return {mw.hw_rkey for mw in verbs.fabric.mws.values() if mw.mr is not None}


async def _next_completion(transport: RdmaTransport):
    return await asyncio.wait_for(transport.completion_queue.get(), 2.0)


# -- availability -----------------------------------------------------------------------------------


def test_rdma_available_says_failed_to_get_devices_list_and_suggests_softroce():
    ok, why = rdma_available(FakeVerbs(no_devices=True))
    assert not ok
    assert "Failed to get devices list" in why
    assert "rdma link add rxe0 type rxe netdev" in why


def test_rdma_available_names_a_device_with_an_active_port():
    assert rdma_available(FakeVerbs()) == (True, "RDMA device rxe0 port 1 is active")


def test_rdma_available_false_when_every_port_is_down():
    ok, why = rdma_available(FakeVerbs(FakeDevice(port_state=e.IBV_PORT_DOWN)))
    assert not ok and "no active port" in why


def test_create_transport_rdma_raises_what_is_missing_without_a_device():
    from kvmesh.shared.transport.auto import create_transport

    ok, why = rdma_available()
    if ok:
        pytest.skip("an RDMA device exists here")
    with pytest.raises(BackendUnavailableError) as info:
        create_transport("rdma")
    assert why in str(info.value)


def test_auto_never_offers_rdma_without_a_device():
    from kvmesh.shared.transport.auto import AutoTransport, available_backends

    if rdma_available()[0]:
        pytest.skip("an RDMA device exists here")
    assert available_backends()["rdma"][0] is False
    assert "rdma" not in AutoTransport(TransportConfig(peer_id="auto")).backends


# -- connection setup -------------------------------------------------------------------------------


async def test_connect_brings_both_qps_through_init_rtr_rts_with_the_peers_info():
    verbs = FakeVerbs()
    async with _pair(verbs) as (receiver, sender):
        ep = await sender.connect(receiver.descriptor())
        modifies = verbs.fabric.events("modify")
        by_qp: dict[int, list] = {}
        for _, qpn, state, mask, attrs in modifies:
            by_qp.setdefault(qpn, []).append((state, mask, attrs))
        assert set(by_qp) == {ep.qp_num, *[q for q in by_qp if q != ep.qp_num]} and len(by_qp) == 2
        for qpn, steps in by_qp.items():
            assert [s for s, _, _ in steps] == [e.IBV_QPS_INIT, e.IBV_QPS_RTR, e.IBV_QPS_RTS]
            init, rtr, rts = (attrs for _, _, attrs in steps)
            assert init["qp_access_flags"] == (
                e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
            )
            assert init["port_num"] == 1
            peer = next(q for q in by_qp if q != qpn)
            peer_rts = by_qp[peer][2][2]
            assert rtr["dest_qp_num"] == peer
            assert rtr["rq_psn"] == peer_rts["sq_psn"]  # I expect the PSN the peer starts at
            assert rtr["path_mtu"] == e.IBV_MTU_1024
            assert rtr["ah"]["is_global"] == 1
            assert rtr["ah"]["dgid"] == receiver.gid  # both ends on the one fake device
            assert rtr["ah"]["sgid_index"] == receiver.gid_index
            assert rts["timeout"] == 14 and rts["retry_cnt"] == 7 and rts["rnr_retry"] == 7
            assert rtr["max_dest_rd_atomic"] >= 1 and rts["max_rd_atomic"] >= 1


async def test_descriptor_carries_device_gid_mtu_and_handshake_address():
    async with _pair(FakeVerbs()) as (receiver, _):
        part = receiver.descriptor().backend("rdma")
        assert part is not None and part.device == "rxe0" and part.port == 1
        # RoCE: the RoCEv2 IPv4-mapped GID is preferred over the link-local one
        assert part.gid.startswith("0000:0000:0000:0000:0000:ffff:") and part.gid_index == 1
        assert part.mtu == e.IBV_MTU_1024
        assert part.handshake_port == receiver.handshake_port > 0


async def test_connect_fails_with_peer_unreachable_when_handshake_peer_hangs_up():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with _pair(FakeVerbs()) as (receiver, sender):
        desc = receiver.descriptor()
        part = msgspec.structs.replace(desc.backend("rdma"), handshake_port=port)
        bad = msgspec.structs.replace(desc, backends=(part,))
        with pytest.raises(PeerUnreachableError, match="handshake"):
            await sender.connect(bad)
    server.close()


async def test_closing_an_endpoint_destroys_the_peers_qp():
    verbs = FakeVerbs()
    async with _pair(verbs) as (receiver, sender):
        ep = await sender.connect(receiver.descriptor())
        peer_qpn = next(q for q in verbs.fabric.qps if q != ep.qp_num)
        await ep.aclose()
        for _ in range(100):
            if peer_qpn not in verbs.fabric.qps:
                break
            await asyncio.sleep(0.01)
        assert ("destroy_qp", peer_qpn) in verbs.fabric.log
        assert ("destroy_qp", ep.qp_num) in verbs.fabric.log


# -- writes -----------------------------------------------------------------------------------------


async def test_write_places_scattered_blocks_and_delivers_one_completion_with_imm():
    async with _connected(FakeVerbs()) as c:
        pairs = [(0, 5), (3, 1), (6, 7)]
        await c.ep.write(_entries(c.src_region, c.dst_region, pairs), imm=0xABC123)
        for s, d in pairs:
            assert torch.equal(
                c.dst[d * BLOCK : (d + 1) * BLOCK], c.src[s * BLOCK : (s + 1) * BLOCK]
            )
        assert not c.dst[0:BLOCK].any()  # untouched block
        done = await _next_completion(c.receiver)
        assert (done.imm, done.peer_id) == (0xABC123, "prefill")
        assert c.receiver.completion_queue.get_nowait() is None  # exactly one per write
        assert c.receiver.stats().writes == 1


async def test_batched_write_chains_wrs_with_imm_and_signal_only_on_the_last():
    verbs = FakeVerbs()
    async with _connected(verbs) as c:
        await c.ep.write(_entries(c.src_region, c.dst_region, [(0, 6), (1, 2), (2, 4)]), imm=7)
        [chain] = _sends(verbs, c.ep.qp_num)
        assert [w["opcode"] for w in chain] == [
            e.IBV_WR_RDMA_WRITE,
            e.IBV_WR_RDMA_WRITE,
            e.IBV_WR_RDMA_WRITE_WITH_IMM,
        ]
        assert [w["send_flags"] for w in chain] == [0, 0, e.IBV_SEND_SIGNALED]
        assert [w["imm_data"] for w in chain] == [0, 0, socket.htonl(7)]
        assert [w["remote_addr"] for w in chain] == [
            c.dst_region.addr + d * BLOCK for d in (6, 2, 4)
        ]
        # the memory window bound over the region, not the window's key
        assert {w["rkey"] for w in chain} == _mw_rkeys(verbs) != {c.dst_region.rkey}
        assert [w["sg"] for w in chain] == [
            [(c.src_region.addr + s * BLOCK, BLOCK, c.src_region.lkey)] for s in (0, 1, 2)
        ]


async def test_blocks_adjacent_at_the_receiver_travel_as_one_wr_with_several_sges():
    verbs = FakeVerbs()
    async with _connected(verbs) as c:
        await c.ep.write(_entries(c.src_region, c.dst_region, [(5, 2), (1, 3), (7, 4)]), imm=1)
        [chain] = _sends(verbs, c.ep.qp_num)
        assert len(chain) == 1 and chain[0]["opcode"] == e.IBV_WR_RDMA_WRITE_WITH_IMM
        assert [a for a, _, _ in chain[0]["sg"]] == [
            c.src_region.addr + s * BLOCK for s in (5, 1, 7)
        ]
        assert torch.equal(c.dst[2 * BLOCK : 3 * BLOCK], c.src[5 * BLOCK : 6 * BLOCK])
        assert torch.equal(c.dst[4 * BLOCK : 5 * BLOCK], c.src[7 * BLOCK : 8 * BLOCK])


async def test_long_batch_is_posted_in_segments_that_fit_the_send_queue():
    verbs = FakeVerbs()
    async with _connected(verbs, num_blocks=16, rdma_send_depth=4) as c:
        pairs = [(i, 15 - 2 * i) for i in range(8)]  # never adjacent: 8 WRs
        await c.ep.write(_entries(c.src_region, c.dst_region, pairs), imm=9)
        chains = _sends(verbs, c.ep.qp_num)
        assert [len(chain) for chain in chains] == [2, 2, 2, 2]
        assert all(chain[-1]["send_flags"] == e.IBV_SEND_SIGNALED for chain in chains)
        opcodes = [w["opcode"] for chain in chains for w in chain]
        assert opcodes == [e.IBV_WR_RDMA_WRITE] * 7 + [e.IBV_WR_RDMA_WRITE_WITH_IMM]
        for s, d in pairs:
            assert torch.equal(
                c.dst[d * BLOCK : (d + 1) * BLOCK], c.src[s * BLOCK : (s + 1) * BLOCK]
            )
        assert (await _next_completion(c.receiver)).imm == 9


async def test_receive_wrs_are_reposted_so_more_writes_than_the_queue_depth_succeed():
    verbs = FakeVerbs()
    async with _connected(verbs, rdma_recv_depth=4) as c:
        imms = []
        for i in range(12):
            await c.ep.write(_entries(c.src_region, c.dst_region, [(i % 8, i % 8)]), imm=100 + i)
            imms.append((await _next_completion(c.receiver)).imm)
        assert imms == list(range(100, 112))  # in write order
        peer_qpn = next(q for q in verbs.fabric.qps if q != c.ep.qp_num)
        reposts = [ev for ev in verbs.fabric.events("post_recv") if ev[1] == peer_qpn]
        assert len(reposts) == 4 + 12


async def test_read_pulls_remote_bytes_with_rdma_read():
    verbs = FakeVerbs()
    async with _connected(verbs) as c:
        c.dst[3 * BLOCK : 4 * BLOCK] = 42
        local = torch.zeros(BLOCK, dtype=torch.uint8)
        local_region = c.sender.register(local)
        entry = WriteEntry(local_region, 0, c.dst_region.addr + 3 * BLOCK, c.dst_region.rkey, BLOCK)
        await c.ep.read([entry])
        assert bool((local == 42).all())
        [chain] = _sends(verbs, c.ep.qp_num)
        assert [w["opcode"] for w in chain] == [e.IBV_WR_RDMA_READ]
        assert c.receiver.completion_queue.get_nowait() is None


# -- failures ---------------------------------------------------------------------------------------


async def test_out_of_bounds_write_to_an_advertised_region_is_refused_before_posting():
    verbs = FakeVerbs(NO_MW)
    async with _connected(verbs) as c:
        bad = WriteEntry(c.src_region, 0, c.dst_region.end - 16, c.dst_region.rkey, BLOCK)
        with pytest.raises(RemoteAccessError) as info:
            await c.ep.write([bad], imm=1)
        assert info.value.reason == RefusalReason.REFUSED
        assert verbs.fabric.events("post_send") == []
        await c.ep.write(_entries(c.src_region, c.dst_region, [(0, 0)]), imm=2)  # still usable


async def test_nic_refusal_of_an_unknown_rkey_is_a_remote_access_error_then_peer_gone():
    async with _connected(FakeVerbs(NO_MW)) as c:
        bad = WriteEntry(c.src_region, 0, c.dst_region.addr, 0xDEAD, BLOCK)
        with pytest.raises(RemoteAccessError) as info:
            await c.ep.write([bad], imm=1)
        assert "IBV_WC_REM_ACCESS_ERR" in str(info.value)
        with pytest.raises(PeerGoneError, match="connect again"):
            await c.ep.write(_entries(c.src_region, c.dst_region, [(0, 0)]), imm=2)


async def test_write_from_an_unregistered_local_region_raises_local_access_error():
    async with _connected(FakeVerbs()) as c:
        stray = c.receiver.register(torch.zeros(BLOCK, dtype=torch.uint8))  # another transport's
        with pytest.raises(LocalAccessError, match="register it"):
            await c.ep.write(
                [WriteEntry(stray, 0, c.dst_region.addr, c.dst_region.rkey, BLOCK)], imm=1
            )


def test_completion_status_maps_to_typed_errors():
    def err(status):
        return completion_error(FakeVerbs(), status, 0, "write")

    assert isinstance(err(e.IBV_WC_REM_ACCESS_ERR), RemoteAccessError)
    assert isinstance(err(e.IBV_WC_LOC_PROT_ERR), LocalAccessError)
    for status in (e.IBV_WC_RETRY_EXC_ERR, e.IBV_WC_RNR_RETRY_EXC_ERR, e.IBV_WC_WR_FLUSH_ERR):
        assert isinstance(err(status), PeerGoneError)
    assert "IBV_WC_RETRY_EXC_ERR" in str(err(e.IBV_WC_RETRY_EXC_ERR))


# -- memory registration ----------------------------------------------------------------------------


async def test_memory_is_registered_with_relaxed_ordering_when_the_device_accepts_it():
    verbs = FakeVerbs(NO_MW)
    async with RdmaTransport(_config("a"), verbs=verbs) as t:
        t.register(torch.zeros(BLOCK, dtype=torch.uint8), Access.REMOTE)
        access = verbs.fabric.events("reg_mr")[-1][1]["access"]
        assert access == (
            e.IBV_ACCESS_LOCAL_WRITE
            | e.IBV_ACCESS_REMOTE_WRITE
            | e.IBV_ACCESS_REMOTE_READ
            | e.IBV_ACCESS_RELAXED_ORDERING
        )


async def test_registration_falls_back_without_relaxed_ordering_when_refused():
    verbs = FakeVerbs(FakeDevice(accepts_relaxed_ordering=False, mw_types=()))
    async with RdmaTransport(_config("a"), verbs=verbs) as t:
        t.register(torch.zeros(BLOCK, dtype=torch.uint8), Access.REMOTE_WRITE)
        access = verbs.fabric.events("reg_mr")[-1][1]["access"]
        assert access == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        assert t.memory.relaxed_ordering is False


async def test_dmabuf_region_is_addressed_by_iova_on_the_wire():
    verbs = FakeVerbs(NO_MW)
    backing = mmap.mmap(-1, 4 * BLOCK)
    pool = torch.frombuffer(backing, dtype=torch.uint8)  # stands in for GPU memory
    base = pool.data_ptr()
    fds = []

    def export(ptr: int, length: int) -> tuple[int, int]:
        fd = os.open(os.devnull, os.O_RDONLY)
        fds.append(fd)
        verbs.fabric.dmabufs[fd] = base
        return fd, ptr - base

    async with (
        RdmaTransport(_config("gpu"), verbs=verbs, dmabuf_exporter=export) as receiver,
        RdmaTransport(_config("prefill"), verbs=verbs) as sender,
    ):
        region = receiver.memory.register_dmabuf(pool[BLOCK:], Access.REMOTE_WRITE)
        [(_, reg)] = verbs.fabric.events("reg_dmabuf_mr")
        assert reg["offset"] == BLOCK and reg["length"] == 3 * BLOCK
        assert receiver.descriptor().backend("rdma").iova == {region.rkey: (region.addr, BLOCK)}
        src = torch.full((BLOCK,), 7, dtype=torch.uint8)
        src_region = sender.register(src)
        ep = await sender.connect(receiver.descriptor())
        await ep.write([WriteEntry(src_region, 0, region.addr + BLOCK, region.rkey, BLOCK)], 5)
        [chain] = _sends(verbs, ep.qp_num)
        assert chain[0]["remote_addr"] == 2 * BLOCK  # iova, not the process address
        assert bool((pool[2 * BLOCK : 3 * BLOCK] == 7).all()) and not pool[BLOCK : 2 * BLOCK].any()
    with pytest.raises(OSError):
        os.fstat(fds[0])  # the exported fd was closed after registration
    del pool


# -- compatibility with the real pyverbs structs ----------------------------------------------------


def test_wr_chains_and_qp_attributes_build_with_real_pyverbs():
    pytest.importorskip("pyverbs.wr", reason="pyverbs not installed (scripts/install_pyverbs.sh)")
    from kvmesh.shared.transport.rdma_device import load_pyverbs
    from kvmesh.shared.transport.rdma_qp import QPInfo, qp_to_init, qp_to_rtr, qp_to_rts

    verbs = load_pyverbs()
    spans = [Span(0x1000 * i, 64, 11, 0x9000 + 0x1000 * i, 22) for i in range(3)]
    ids = iter(range(1, 10))
    [segment] = build_segments(
        verbs, spans, read=False, imm=5, limits=QPLimits(), next_wr_id=lambda: next(ids)
    )
    assert [w.opcode for w in segment.wrs] == [
        verbs.e.IBV_WR_RDMA_WRITE,
        verbs.e.IBV_WR_RDMA_WRITE,
        verbs.e.IBV_WR_RDMA_WRITE_WITH_IMM,
    ]
    assert segment.wrs[-1].imm_data == socket.htonl(5)
    assert segment.wrs[-1].send_flags == verbs.e.IBV_SEND_SIGNALED

    class RecordingQP:
        def __init__(self):
            self.masks = []

        def modify(self, attr, mask):
            self.masks.append((attr.qp_state, mask))

    qp = RecordingQP()
    local = QPInfo(1, 2, "fe80:0000:0000:0000:0000:00ff:fe00:0001", 0, 0, 1, 3)
    remote = QPInfo(7, 9, "fe80:0000:0000:0000:0000:00ff:fe00:0002", 0, 0, 1, 5)
    qp_to_init(verbs, qp, 1)
    qp_to_rtr(verbs, qp, local, remote, QPLimits())
    qp_to_rts(verbs, qp, local, QPLimits())
    assert [s for s, _ in qp.masks] == [
        verbs.e.IBV_QPS_INIT,
        verbs.e.IBV_QPS_RTR,
        verbs.e.IBV_QPS_RTS,
    ]


# -- real device ------------------------------------------------------------------------------------


@pytest.mark.rdma
async def test_real_loopback_write_with_imm_round_trip():
    ok, why = rdma_available()
    if not ok:
        pytest.skip(why)
    async with (
        RdmaTransport(TransportConfig(peer_id="decode")) as receiver,
        RdmaTransport(TransportConfig(peer_id="prefill")) as sender,
    ):
        dst, dst_region, src, src_region = _pools(receiver, sender)
        ep = await sender.connect(receiver.descriptor())
        pairs = [(0, 5), (1, 6), (4, 2)]
        await ep.write(_entries(src_region, dst_region, pairs), imm=0x12345)
        done = await _next_completion(receiver)
        assert (done.imm, done.peer_id) == (0x12345, "prefill")
        for s, d in pairs:
            assert torch.equal(dst[d * BLOCK : (d + 1) * BLOCK], src[s * BLOCK : (s + 1) * BLOCK])
        await ep.aclose()
