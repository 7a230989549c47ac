"""shm and tcp backends across real processes: KVPool blocks land bit-exact, one completion per
write in order, refusals leave every byte outside the target alone, dead peers fail cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

import msgspec
import pytest
import torch
from kvmesh.shared.kv.imm import pack_imm
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool
from kvmesh.shared.transport import (
    Access,
    Completion,
    PeerGoneError,
    RefusalReason,
    RemoteAccessError,
    Transport,
    TransportConfig,
    TransportDescriptor,
    WriteEntry,
    create_transport,
)
from support.transport_wire import remote

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 32 KiB blocks
BB = SPEC.block_bytes
NUM_BLOCKS = 64  # receiver pool
GUARD = 0xAB
BACKENDS = ["shm", "tcp"]
# tcp: slices smaller than a block and 3 lanes, so every write is cut and spread across lanes
CONFIG = {"tcp_lanes": 3, "tcp_slice_bytes": 12 << 10, "tcp_window": 4}
# forkserver: one clean (thread-free) server imports torch once; each peer process forks from it
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "kvmesh.shared.transport", "kvmesh.shared.kv.kv_cache"])


def pattern(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def timeout(coro: Any, seconds: float = 20.0) -> Any:
    return asyncio.wait_for(coro, seconds)


class Target:
    """A receiver KVPool over transport memory, with guard blocks on both sides of the region."""

    def __init__(self, rx: Transport) -> None:
        self.mem = rx.allocate((NUM_BLOCKS + 2) * BB)
        self.mem.fill_(GUARD)
        self.pool = KVPool(SPEC, NUM_BLOCKS, buffer=self.mem[BB : BB + NUM_BLOCKS * BB])
        self.pool.raw.zero_()
        self.registered = rx.register(self.pool.raw, Access.REMOTE)
        self.region = remote(rx, self.registered)  # as peers reach it: a window over it all

    def descriptor(self, rx: Transport) -> bytes:
        """The receiver's descriptor for a writer process, naming the window as its region, in
        its wire form (``wire_descriptor`` reads it)."""
        return msgspec.json.encode(msgspec.structs.replace(rx.descriptor(), regions=(self.region,)))

    def guards_intact(self) -> bool:
        return bool((self.mem[:BB] == GUARD).all() and (self.mem[-BB:] == GUARD).all())


@contextlib.asynccontextmanager
async def _target_and_writer(backend: str, src: torch.Tensor):
    """A receiver with a Target pool and a writer with ``src`` registered (not yet connected):
    yields the receiver, the writer, the target and ``src``'s region."""
    cfg = TransportConfig(**CONFIG)
    async with create_transport(backend, cfg) as rx, create_transport(backend, cfg) as tx:
        target = Target(rx)
        yield rx, tx, target, tx.register(src)


# -- child processes ---------------------------------------------------------------------------------


def wire_descriptor(wire: bytes) -> TransportDescriptor:
    return msgspec.json.decode(wire, type=TransportDescriptor)


def writer_main(backend: str, desc: bytes, seed: int, plan: list[list[int]], out: Any) -> None:
    """Write ``plan`` (per write: destination block ids) from a seeded source pool, then read back.
    An empty plan writes block ``seed`` over and over until the process is killed."""
    try:
        asyncio.run(_write_plan(backend, desc, seed, plan, out))
    except BaseException as exc:
        out.put(("error", seed, repr(exc)))
        raise


async def _write_plan(
    backend: str, desc: bytes, seed: int, plan: list[list[int]], out: Any
) -> None:
    async with create_transport(backend, TransportConfig(**CONFIG)) as tx:
        num_src = max(sum(len(w) for w in plan), 1)
        src = KVPool(SPEC, num_src)
        src.raw.copy_(pattern(seed, src.nbytes))
        local = tx.register(src.raw)
        peer = wire_descriptor(desc)
        region = peer.regions[0]

        def entry(src_block: int, dst_block: int) -> WriteEntry:
            off = src.block_offset(src_block)
            return WriteEntry(local, off, region.addr + dst_block * BB, region.rkey, BB)

        async with await tx.connect(peer) as ep:
            if not plan:
                for i in range(1 << 30):
                    await ep.write([entry(0, seed)], i % 4096)
                    if i == 0:
                        out.put(("started", seed, ""))
            b = 0
            for i, dst_blocks in enumerate(plan):
                await ep.write(
                    [entry(b + k, d) for k, d in enumerate(dst_blocks)], pack_imm(seed, i)
                )
                b += len(dst_blocks)
            back = KVPool(SPEC, 1)
            back_region = tx.register(back.raw)
            first = plan[0][0]
            await ep.read([WriteEntry(back_region, 0, region.addr + first * BB, region.rkey, BB)])
            ok = torch.equal(back.raw, src.raw[:BB])
            out.put(("done", seed, "read ok" if ok else "read mismatch"))


def receiver_main(backend: str, out: Any) -> None:
    async def main() -> None:
        async with create_transport(backend, TransportConfig(**CONFIG)) as rx:
            target = Target(rx)
            out.put(target.descriptor(rx))
            await asyncio.sleep(60)
            del target

    asyncio.run(main())


async def next_message(q: Any, seconds: float = 30.0) -> Any:
    return await asyncio.to_thread(q.get, True, seconds)


async def collect(rx: Transport, n: int) -> list[Completion]:
    return [await timeout(rx.completion_queue.get()) for _ in range(n)]


def remove_segments_of(pid: int) -> None:
    """A SIGKILLed receiver cannot unlink its segments; the test cleans up after it."""
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"kvmesh-{pid}-"):
            os.unlink(os.path.join("/dev/shm", name))


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
async def test_scattered_blocks_from_two_writer_processes_land_bit_exact_in_order(
    backend: str,
) -> None:
    async with create_transport(backend, TransportConfig(**CONFIG)) as rx:
        target = Target(rx)
        desc = target.descriptor(rx)
        # writer 1 fills the even blocks, writer 2 the odd ones, 6 writes of 5 scattered blocks each
        plans = {
            seed: [[(2 * ((7 * (5 * w + k)) % 32) + parity) for k in range(5)] for w in range(6)]
            for seed, parity in ((11, 0), (12, 1))
        }
        out = CTX.Queue()
        procs = [
            CTX.Process(target=writer_main, args=(backend, desc, seed, plan, out))
            for seed, plan in plans.items()
        ]
        for p in procs:
            p.start()
        try:
            completions = await collect(rx, 12)
            messages = [await next_message(out) for _ in range(2)]
        finally:
            for p in procs:
                p.join(timeout=20)
        assert sorted(m for m in messages if m[0] == "done") == [
            ("done", 11, "read ok"),
            ("done", 12, "read ok"),
        ]
        await asyncio.sleep(0.2)
        assert rx.completion_queue.get_nowait() is None  # exactly one completion per write
        by_peer: dict[str, list[int]] = {}
        for c in completions:
            assert c.num_bytes == 5 * BB
            by_peer.setdefault(c.peer_id, []).append(c.imm)
        assert sorted(by_peer.values()) == [
            [pack_imm(seed, i) for i in range(6)] for seed in sorted(plans)
        ]
        for seed, plan in plans.items():
            src = pattern(seed, 30 * BB)
            for b, dst in enumerate(x for w in plan for x in w):
                assert torch.equal(target.pool.block_bytes_view(dst), src[b * BB : (b + 1) * BB])
        assert target.guards_intact()
        stats = rx.stats()
        assert (stats.writes, stats.bytes, stats.refused, stats.reads) == (12, 60 * BB, 0, 2)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_bad_writes_are_refused_and_nothing_outside_the_target_changes(backend: str) -> None:
    src = torch.full((4 * BB,), 0x5C, dtype=torch.uint8)
    async with _target_and_writer(backend, src) as (rx, tx, target, local):
        ep = await tx.connect(rx.descriptor())
        r = target.region
        before = target.mem.clone()
        ro = remote(rx, rx.register(target.pool.block_bytes_view(3), Access.REMOTE_READ))
        bad = {
            "unknown_rkey": WriteEntry(local, 0, r.addr, r.rkey ^ 0x1234, BB),
            "before_start": WriteEntry(local, 0, r.addr - 8, r.rkey, 64),
            "past_end": WriteEntry(local, 0, r.end - BB + 8, r.rkey, BB),
            "region_key": WriteEntry(local, 0, r.addr, target.registered.rkey, BB),
            "read_only": WriteEntry(local, 0, ro.addr, ro.rkey, 64),
        }
        for name, entry in bad.items():  # refused alike: no oracle for a prober
            with pytest.raises(RemoteAccessError) as info:
                await timeout(ep.write([entry], 1))
            assert info.value.reason == RefusalReason.REFUSED, name
        assert torch.equal(target.mem, before)
        # a good write still goes through on the same endpoint
        await timeout(ep.write([WriteEntry(local, 0, r.addr, r.rkey, BB)], 7))
        assert (await timeout(rx.completion_queue.get())).imm == 7
        assert bool((target.pool.block_bytes_view(0) == 0x5C).all())
        rx.deregister(target.registered)
        with pytest.raises(RemoteAccessError, match="refused"):
            await timeout(ep.write([WriteEntry(local, 0, r.addr + BB, r.rkey, BB)], 8))
        assert bool((target.pool.block_bytes_view(1) == 0).all())
        assert target.guards_intact()
        await asyncio.sleep(0.1)  # shm: refusal notices travel asynchronously
        stats = rx.stats()
        assert (stats.writes, stats.refused) == (1, 6)
        assert rx.completion_queue.get_nowait() is None
        await ep.aclose()


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrent_writes_on_one_endpoint_complete_in_call_order(backend: str) -> None:
    src = pattern(3, NUM_BLOCKS * BB)
    async with _target_and_writer(backend, src) as (rx, tx, target, local):
        r = target.region
        async with await tx.connect(rx.descriptor()) as ep:
            # big and small writes interleaved: later small ones would finish first if unordered
            sizes = [16, 1, 8, 1, 2, 1, 16, 1, 4, 1]
            writes, b = [], 0
            for i, n in enumerate(sizes):
                entries = [
                    WriteEntry(local, (b + k) * BB, r.addr + (b + k) * BB, r.rkey, BB)
                    for k in range(n)
                ]
                writes.append(ep.write(entries, i))
                b += n
            await timeout(asyncio.gather(*writes))
            completions = await collect(rx, len(sizes))
        assert [c.imm for c in completions] == list(range(len(sizes)))
        assert [c.num_bytes for c in completions] == [n * BB for n in sizes]
        assert torch.equal(target.pool.raw[: b * BB], src[: b * BB])


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_cancelled_write_still_completes_so_later_writes_are_not_held_back(
    backend: str,
) -> None:
    src = pattern(4, NUM_BLOCKS * BB)
    async with _target_and_writer(backend, src) as (rx, tx, target, local):
        r = target.region
        async with await tx.connect(rx.descriptor()) as ep:
            first = asyncio.ensure_future(
                ep.write([WriteEntry(local, 0, r.addr, r.rkey, r.length)], 1)
            )
            await asyncio.sleep(0)
            first.cancel()
            await timeout(ep.write([WriteEntry(local, 0, r.addr, r.rkey, BB)], 2))
        assert [c.imm for c in await collect(rx, 2)] == [1, 2]
        assert torch.equal(target.pool.raw, src)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_writer_gets_peer_gone_when_the_receiver_dies(backend: str) -> None:
    out = CTX.Queue()
    proc = CTX.Process(target=receiver_main, args=(backend, out))
    proc.start()
    try:
        desc = wire_descriptor(await next_message(out))
        async with create_transport(backend, TransportConfig(**CONFIG)) as tx:
            src = torch.ones(2 * BB, dtype=torch.uint8)
            local = tx.register(src)
            r = desc.regions[0]
            ep = await tx.connect(desc)
            entries = [WriteEntry(local, 0, r.addr, r.rkey, 2 * BB)]
            await timeout(ep.write(entries, 1))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
            with pytest.raises(PeerGoneError, match=r"went away|closed"):
                for i in range(50):  # the first writes may still be buffered by the kernel
                    await timeout(ep.write(entries, 2 + i))
                    await asyncio.sleep(0.05)
            with pytest.raises(PeerGoneError):
                await timeout(ep.write(entries, 99))
            await ep.aclose()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
        remove_segments_of(proc.pid)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_receiver_keeps_serving_after_a_writer_is_killed_mid_transfer(backend: str) -> None:
    cfg = TransportConfig(**CONFIG)
    async with create_transport(backend, cfg) as rx, create_transport(backend, cfg) as tx:
        target = Target(rx)
        out = CTX.Queue()
        # an empty plan makes the child write one block forever, as fast as it can
        proc = CTX.Process(target=writer_main, args=(backend, target.descriptor(rx), 5, [], out))
        proc.start()
        try:
            assert (await next_message(out))[0] == "started"
            await timeout(rx.completion_queue.get())
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.join(timeout=10)
            remove_segments_of(proc.pid)
        src = torch.full((BB,), 0x77, dtype=torch.uint8)
        local = tx.register(src)
        r = target.region
        async with await tx.connect(rx.descriptor()) as ep:
            for i in range(3):
                await timeout(
                    ep.write([WriteEntry(local, 0, r.addr + 9 * BB, r.rkey, BB)], 100 + i)
                )
        imms = []
        while len(imms) < 3:
            c = await timeout(rx.completion_queue.get())
            if c.peer_id == tx.peer_id:
                imms.append(c.imm)
        assert imms == [100, 101, 102]
        assert bool((target.pool.block_bytes_view(9) == 0x77).all())
        assert target.guards_intact()


def _segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvmesh-{os.getpid()}-")}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
async def test_transport_closes_without_leaking_threads_fds_or_segments(backend: str) -> None:
    threads, shm, fds = set(threading.enumerate()), _segments(), _fds()
    cfg = TransportConfig(**CONFIG)
    async with create_transport(backend, cfg) as rx, create_transport(backend, cfg) as tx:
        target = Target(rx)
        if backend != "tcp":
            assert _segments() - shm  # the pool lives in a segment
        src = torch.ones(BB, dtype=torch.uint8)
        local = tx.register(src)
        ep = await tx.connect(rx.descriptor())
        await timeout(
            ep.write([WriteEntry(local, 0, target.region.addr, target.region.rkey, BB)], 1)
        )
        await timeout(rx.completion_queue.get())
        # the endpoint is left open on purpose: closing the transport closes it
    del target

    def leftover() -> set[threading.Thread]:
        # asyncio.to_thread's pool belongs to the event loop, not to the transport
        return {
            t
            for t in threading.enumerate()
            if t not in threads and not t.name.startswith("asyncio")
        }

    for _ in range(50):
        if not leftover():
            break
        await asyncio.sleep(0.05)
    assert not leftover()
    assert _segments() == shm
    with contextlib.suppress(FileNotFoundError):
        assert _fds() - fds == set()


async def test_auto_uses_shm_on_the_same_host_and_falls_back_to_tcp() -> None:
    cfg = TransportConfig(**CONFIG)
    async with create_transport("auto", cfg) as rx, create_transport("auto", cfg) as tx:
        target = Target(rx)  # shm memory, served by both backends
        src = pattern(6, 2 * BB)
        local = tx.register(src)
        r = target.region
        desc = rx.descriptor()
        assert {"shm", "tcp"} <= set(desc.backend_names)
        tcp_only = msgspec.structs.replace(
            desc, host_id="another-host", backends=(desc.backend("tcp"),)
        )
        for peer, backend, block in ((desc, "shm", 0), (tcp_only, "tcp", 1)):
            async with await tx.connect(peer) as ep:
                assert ep.backend == backend
                await timeout(
                    ep.write(
                        [WriteEntry(local, block * BB, r.addr + block * BB, r.rkey, BB)], block
                    )
                )
        # two endpoints: completions are ordered per endpoint only
        assert sorted(c.imm for c in await collect(rx, 2)) == [0, 1]
        assert torch.equal(target.pool.raw[: 2 * BB], src)
        assert rx.stats().writes == 2


async def test_auto_stops_offering_shm_when_a_region_lies_outside_shared_memory() -> None:
    async with create_transport("auto", TransportConfig(**CONFIG)) as rx:
        inside = rx.register(rx.allocate(BB), Access.REMOTE_WRITE)
        assert "shm" in rx.descriptor().backend_names
        outside = rx.register(torch.zeros(BB, dtype=torch.uint8), Access.REMOTE_WRITE)
        assert set(rx.descriptor().backend_names) == {"tcp"}
        rx.deregister(outside)
        assert "shm" in rx.descriptor().backend_names
        assert rx.descriptor().regions == (inside,)
