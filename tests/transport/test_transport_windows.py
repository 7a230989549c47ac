"""Memory windows on shm, tcp and rdma (on tests/support/fake_pyverbs.py): a key to a reservation's blocks
alone, refused outside its spans and after it closes; immediates count only with a live key
(security issue, lease-scoped writes). rdma-only behaviour (the NIC's refusals, binding per
connection, the fallback without memory windows) is in tests/transport/test_transport_rdma_windows.py."""

from __future__ import annotations

import asyncio
import socket

import pytest
from kvmesh.shared.transport import (
    Access,
    MemoryWindow,
    RefusalReason,
    RemoteAccessError,
    TransportConfig,
    TransportError,
    create_transport,
)
from kvmesh.shared.transport.base import merge_spans
from kvmesh.shared.transport.shm import NOTE, OP_HELLO, OP_WRITE_DONE
from support.fake_pyverbs import FakeVerbs
from support.transport_windows import BLOCK, PoolPair, make_transport

NUM_BLOCKS = 16
BACKENDS = ["shm", "tcp", "rdma"]
MAX_REFUSALS = 4


class Pair(PoolPair):
    """A receiver with a pool of NUM_BLOCKS blocks and a writer connected to it."""

    def __init__(self, backend: str) -> None:
        config = TransportConfig(max_refusals=MAX_REFUSALS)
        verbs = FakeVerbs()  # one fabric for both ends (rdma only)
        rx, tx = (make_transport(backend, config, verbs) for _ in range(2))
        super().__init__(rx, tx, NUM_BLOCKS)


def test_merge_spans_joins_touching_spans_and_refuses_empty_ones() -> None:
    assert merge_spans([(8, 4), (0, 4), (4, 4), (20, 1)]) == ((0, 12), (20, 1))
    with pytest.raises(ValueError, match="positive length"):
        merge_spans([(0, 0)])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_write_lands_with_its_key_in_the_completion_keys(backend: str) -> None:
    async with Pair(backend) as p:
        window = p.window(3, 4, 9)
        assert window.spans == ((p.addr(3), 2 * BLOCK), (p.addr(9), BLOCK))
        assert window.rkey != p.region.rkey and window.enforced
        await p.write(4, window.rkey, imm=41)
        (done,) = await p.completions(1)
        # tcp and shm: the key the write used; rdma: the windows its connection resolved
        assert (done.imm, done.keys, done.num_bytes) == (41, frozenset({window.rkey}), BLOCK)
        assert p.written() == [4]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_write_outside_its_blocks_is_refused_and_writes_nothing(backend: str) -> None:
    async with Pair(backend) as p:
        mine, other = p.window(2), p.window(5)
        for block in (1, 3, 5):  # unleased blocks, and another lease's block
            with pytest.raises(RemoteAccessError) as info:
                await p.write(block, mine.rkey)
            assert info.value.reason == RefusalReason.REFUSED
        await p.write(5, other.rkey)
        await p.completions(1)
        assert p.written() == [5]
        # rdma's endpoint refuses these before the NIC, which would end the connection (RC);
        # the NIC's refusals of forged posts are counted (tests/transport/test_transport_rdma_windows.py)
        assert p.rx.stats().refused == (0 if backend == "rdma" else 3)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_closed_refuses_every_later_write(backend: str) -> None:
    async with Pair(backend) as p:
        window = p.window(6)
        await p.write(6, window.rkey)
        await p.completions(1)
        p.mem.zero_()
        p.rx.close_window(window)
        p.rx.close_window(window)  # closing twice is harmless
        with pytest.raises(RemoteAccessError) as info:
            await p.write(6, window.rkey)
        assert info.value.reason == RefusalReason.REFUSED  # the NIC, too, says only that
        assert p.written() == [] and p.rx.completion_queue.qsize() == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_guessed_key_is_refused_without_a_completion(backend: str) -> None:
    async with Pair(backend) as p:
        window = p.window(0)
        for guess in (window.rkey + 1, window.rkey ^ 0x8000_0000, 12345):
            with pytest.raises(RemoteAccessError):
                await p.write(0, guess)
        assert p.written() == [] and p.rx.completion_queue.qsize() == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_region_key_opens_nothing_from_the_network(backend: str) -> None:
    """Issue #27: the region's own key (an odd 31-bit number, counted up) wrote anywhere in
    the pool. Peers reach memory through live windows only, on every backend."""
    async with Pair(backend) as p:
        with pytest.raises(RemoteAccessError) as info:
            await p.write(3, p.region.rkey)
        assert info.value.reason == RefusalReason.REFUSED
        assert p.written() == [] and p.rx.completion_queue.qsize() == 0


@pytest.mark.parametrize("backend", BACKENDS)
async def test_refusals_answer_alike_whatever_the_reason(backend: str) -> None:
    """Issue #27: an unknown key, a closed window's key and a live key outside its window were
    told apart on the wire (a key oracle). Each is now just refused."""
    async with Pair(backend) as p:
        live, closed = p.window(2), p.window(4)
        p.rx.close_window(closed)
        reasons = {}
        for name, block, rkey in (
            ("unknown", 2, live.rkey ^ 0x5A5A_0000),
            ("closed", 4, closed.rkey),
            ("outside", 3, live.rkey),
        ):
            with pytest.raises(RemoteAccessError) as info:
                await p.write(block, rkey)
            reasons[name] = info.value.reason
        assert set(reasons.values()) == {RefusalReason.REFUSED}, reasons


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_writer_that_keeps_presenting_bad_keys_is_disconnected(backend: str) -> None:
    """Issue #27: about 25,000 probes a second were counted and never disconnected."""
    async with Pair(backend) as p:
        window = p.window(1)
        for guess in range(1, MAX_REFUSALS + 1):
            with pytest.raises(TransportError):
                await p.write(1, window.rkey ^ guess)
        await asyncio.sleep(0.2)  # shm: refusal notices travel asynchronously
        with pytest.raises(TransportError):  # the receiver hung up on this writer
            for imm in range(50):  # a write or two may still be buffered by the kernel
                await p.write(1, window.rkey, imm)
                assert p.rx.completion_queue.get_nowait() is None, "served after probing"
                await asyncio.sleep(0.02)
        async with await p.connect() as fresh:  # other connections are served
            await p.write(1, window.rkey, 9, ep=fresh)
        assert [c.imm for c in await p.completions(1)] == [9]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_deregistering_the_region_closes_its_windows(backend: str) -> None:
    async with Pair(backend) as p:
        window = p.window(1)
        p.rx.deregister(p.region)
        with pytest.raises(RemoteAccessError):
            await p.write(1, window.rkey)
        assert p.written() == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_window_spans_outside_the_region_or_wider_access_are_refused(backend: str) -> None:
    async with Pair(backend) as p:
        with pytest.raises(ValueError, match="outside region"):
            p.rx.open_window(p.region, [(p.addr(NUM_BLOCKS - 1), 2 * BLOCK)])
        with pytest.raises(ValueError, match="grants"):
            p.rx.open_window(p.region, [(p.addr(0), BLOCK)], Access.REMOTE)


async def test_shm_forged_write_done_with_a_dead_key_is_refused_not_completed() -> None:
    """shm copies on the writer's side, so the receiver checks the key its immediate names."""
    async with Pair("shm") as p:
        window = p.window(2)
        refused = p.rx.stats().refused
        peer = b"forger"
        loop = asyncio.get_running_loop()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.setblocking(False)
            await loop.sock_connect(s, p.rx.socket_path)
            hello = NOTE.pack(OP_HELLO, 0, 0, 0, 0, 0, len(peer)) + peer
            forged = NOTE.pack(OP_WRITE_DONE, 0, 0, 7, window.rkey ^ 1, 1, BLOCK)
            await loop.sock_sendall(s, hello + forged)
            assert await p.refused_after(refused + 1) == refused + 1
        assert p.rx.completion_queue.qsize() == 0


def test_public_descriptor_of_tcp_carries_no_region_key() -> None:
    async def main() -> None:
        async with create_transport("tcp", TransportConfig()) as t:
            mem = t.allocate(BLOCK)
            r = t.register(mem, Access.REMOTE_WRITE)
            assert t.descriptor().region(r.rkey) == r
            assert t.descriptor().public().regions == ()

    asyncio.run(main())


def test_window_covers_checks_whole_span() -> None:
    w = MemoryWindow(1, 2, ((100, 10), (200, 10)), Access.REMOTE_WRITE)
    assert w.covers(100, 10) and w.covers(205, 5)
    assert not w.covers(105, 10) and not w.covers(150, 1)
