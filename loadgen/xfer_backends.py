"""The two ends of a ``kvmesh bench xfer`` transfer, per backend: the torch side of the benchmark.

A spawned receiver process owns the destination KVPool; this process sends from the source pool
(memcpy copies within this process). ``bench_backend`` runs every Plan through one backend and
checks the destination's CRC32 against the source's.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import socket
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from kvmesh.loadgen.bench_xfer import BLOCK_BYTES, Result, XferPlan
from kvmesh.shared.kv.kv_cache import KVCacheSpec, KVPool

if TYPE_CHECKING:
    from kvmesh.shared.transport import (
        Access,
        MemoryRegion,
        Transport,
        TransportDescriptor,
        WriteEntry,
    )

SPEC = KVCacheSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
assert SPEC.block_bytes == BLOCK_BYTES, (SPEC.block_bytes, BLOCK_BYTES)
_TIMEOUT_S = 600.0


def fill_source(pool: KVPool, blocks: Sequence[int]) -> None:
    """Distinct, cheap content per 8 bytes, so a misplaced or missing block changes the CRC."""
    words = SPEC.block_bytes // 8
    for b in blocks:
        view = pool.block_bytes_view(b).view(torch.int64)  # (words,)
        torch.arange(b * words, (b + 1) * words, out=view).mul_(0x9E3779B97F4A7C15 - (1 << 64))


def blocks_crc(pool: KVPool, blocks: Sequence[int]) -> int:
    crc = 0
    for b in blocks:
        crc = zlib.crc32(pool.block_bytes_view(b).numpy(), crc)
    return crc


def byte_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy()).cast("B")


# ---------------------------------------------------------------------------------------------------
# The spawned process and the pool it exposes to this one (``kvmesh bench kv`` shares them).

PlansBody = Callable[[Any, str, list[XferPlan]], None]


@contextlib.contextmanager
def spawned(role: str, body: PlansBody, backend: str, plans: list[XferPlan]) -> Iterator[Any]:
    """This end of a Pipe to ``body(conn, backend, plans)`` run in a spawned process with one
    torch thread (``body`` a module-level function); what it raises comes here as an "error"
    message (``_expect`` raises it), its death as EOF. On exit the process is joined (terminated
    if it has not ended within 30 s)."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(
        target=_spawned_main, args=(child_conn, role, body, backend, plans), daemon=True
    )
    proc.start()
    child_conn.close()  # so that the child's death reads as EOF here
    try:
        yield conn
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join()


def _spawned_main(
    conn: Any, role: str, body: PlansBody, backend: str, plans: list[XferPlan]
) -> None:
    torch.set_num_threads(1)
    try:
        body(conn, backend, plans)
    except BaseException as exc:
        conn.send(("error", f"{backend} {role}: {exc!r}"))
        raise


@contextlib.contextmanager
def exposed_pool(t: Transport, conn: Any, plan: XferPlan, access: Access) -> Iterator[KVPool]:
    """``plan``'s destination pool in ``t``'s memory, registered with ``access`` behind one window
    of that access over all of it; ``t``'s descriptor and the window (the region with the
    window's key) are sent on ``conn`` as "ready". On exit the window is closed and the region
    deregistered."""
    pool = KVPool(SPEC, plan.pool_blocks, buffer=t.allocate(plan.pool_blocks * SPEC.block_bytes))
    region = t.register(pool.raw, access)
    # peers get a window's key, as from a decode worker (on rdma with memory windows the
    # region's own key opens nothing); one span, so the check costs what it did
    window = t.open_window(region, [(region.addr, region.length)], access)
    target = msgspec.structs.replace(region, rkey=window.rkey)
    conn.send(("ready", (t.descriptor(), target)))  # typed values, pickled
    yield pool
    t.close_window(window)
    t.deregister(region)


# ---------------------------------------------------------------------------------------------------
# Receivers: run in a spawned process; talk to the sender over a multiprocessing Pipe.


def _receive(conn: Any, backend: str, plans: list[XferPlan]) -> None:
    if backend == "socket":
        _socket_receiver(conn, plans)
    elif backend == "gloo":
        _gloo_receiver(conn, plans)
    else:
        asyncio.run(_transport_receiver(conn, backend, plans))


def _socket_receiver(conn: Any, plans: list[XferPlan]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        conn.send(("ready", server.getsockname()[1]))
        sock, _ = server.accept()
    with sock:
        for plan in plans:
            pool = KVPool(SPEC, plan.pool_blocks)
            views = [byte_view(pool.block_bytes_view(b)) for b in plan.dst_blocks]
            for _ in range(plan.runs):
                for view in views:
                    got = 0
                    while got < len(view):
                        n = sock.recv_into(view[got:])
                        if n == 0:
                            raise ConnectionError("sender closed the socket mid-transfer")
                        got += n
                sock.sendall(b"\x01")
            conn.send(("done", blocks_crc(pool, plan.dst_blocks), None))
            del views, pool


def _gloo_receiver(conn: Any, plans: list[XferPlan]) -> None:
    import torch.distributed as dist

    port = conn.recv()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    ack = torch.ones(1, dtype=torch.uint8)
    try:
        for plan in plans:
            pool = KVPool(SPEC, plan.pool_blocks)
            views = [pool.block_bytes_view(b) for b in plan.dst_blocks]
            for _ in range(plan.runs):
                for view in views:
                    dist.recv(view, src=0)
                dist.send(ack, dst=0)
            conn.send(("done", blocks_crc(pool, plan.dst_blocks), None))
            del views, pool
    finally:
        dist.destroy_process_group()


def _transport(backend: str, peer_id: str) -> Any:
    """A kvmesh transport for ``backend``: "tcp" is TCP over loopback, "tcp-unix" the tcp
    transport over its same-host unix socket (``unix_lanes``)."""
    from kvmesh.shared.transport import TransportConfig, create_transport

    unix = backend == "tcp-unix"
    config = TransportConfig(peer_id=peer_id, tcp_unix_lanes=unix)
    return create_transport("tcp" if unix else backend, config)


async def _transport_receiver(conn: Any, backend: str, plans: list[XferPlan]) -> None:
    from kvmesh.shared.transport import Access

    for plan in plans:
        async with _transport(backend, "bench-recv") as t:
            with exposed_pool(t, conn, plan, Access.REMOTE_WRITE) as pool:
                imms = []
                for _ in range(plan.runs):
                    done = await asyncio.wait_for(t.completion_queue.get(), _TIMEOUT_S)
                    imms.append(done.imm)
                conn.send(("done", blocks_crc(pool, plan.dst_blocks), imms))
                await asyncio.to_thread(conn.recv)  # the sender has closed its endpoint
            del pool


# ---------------------------------------------------------------------------------------------------
# Senders: this process. Each returns the seconds of every run (warm-up included).


def _expect(conn: Any, tag: str) -> Any:
    if not conn.poll(_TIMEOUT_S):
        raise TimeoutError(f"receiver sent nothing for {_TIMEOUT_S:.0f} s (waiting for {tag})")
    try:
        kind, payload, *rest = conn.recv()
    except EOFError:
        raise RuntimeError(
            f"the receiver process died (waiting for {tag}); see its stderr"
        ) from None
    if kind == "error":
        raise RuntimeError(payload)
    assert kind == tag, (kind, tag)
    return (payload, *rest) if rest else payload


async def expect_target(conn: Any) -> tuple[TransportDescriptor, MemoryRegion]:
    """The peer's descriptor and the window over its pool, from its "ready" (``exposed_pool``)."""
    desc, region = await asyncio.to_thread(_expect, conn, "ready")
    return desc, region


def block_entries(
    local: MemoryRegion, src: KVPool, plan: XferPlan, target: MemoryRegion
) -> list[WriteEntry]:
    """One entry a block: ``plan``'s source blocks at their offsets in ``src``'s layout within
    ``local`` (a region over ``src``, or over a pool of its layout), its destination blocks in
    ``target``."""
    from kvmesh.shared.transport import WriteEntry

    return [
        WriteEntry(
            local,
            src.block_offset(s),
            target.addr + d * SPEC.block_bytes,
            target.rkey,
            SPEC.block_bytes,
        )
        for s, d in zip(plan.src_blocks, plan.dst_blocks, strict=True)
    ]


def _source(plan: XferPlan) -> KVPool:
    pool = KVPool(SPEC, plan.pool_blocks)
    fill_source(pool, plan.src_blocks)
    return pool


def _memcpy_run(plan: XferPlan) -> tuple[list[float], bool]:
    src, dst = _source(plan), KVPool(SPEC, plan.pool_blocks)
    pairs = [
        (dst.block_bytes_view(d), src.block_bytes_view(s))
        for s, d in zip(plan.src_blocks, plan.dst_blocks, strict=True)
    ]
    times = []
    for _ in range(plan.runs):
        t0 = time.perf_counter()
        for d, s in pairs:
            d.copy_(s)
        times.append(time.perf_counter() - t0)
    return times, blocks_crc(dst, plan.dst_blocks) == blocks_crc(src, plan.src_blocks)


class _SocketSender:
    def __init__(self, conn: Any) -> None:
        self.sock = socket.create_connection(("127.0.0.1", _expect(conn, "ready")))

    def run(self, plan: XferPlan, src: KVPool) -> list[float]:
        views = [byte_view(src.block_bytes_view(b)) for b in plan.src_blocks]
        ack = bytearray(1)
        times = []
        for _ in range(plan.runs):
            t0 = time.perf_counter()
            for view in views:
                self.sock.sendall(view)
            if self.sock.recv_into(ack) != 1:
                raise ConnectionError("socket receiver closed before acking")
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.sock.close()


class _GlooSender:
    def __init__(self, conn: Any) -> None:
        import torch.distributed as dist
        from kvmesh.shared.config.ports import free_port

        port = free_port()  # gloo binds it later: not one an outgoing connection may take
        conn.send(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        self.dist = dist

    def run(self, plan: XferPlan, src: KVPool) -> list[float]:
        views = [src.block_bytes_view(b) for b in plan.src_blocks]
        ack = torch.zeros(1, dtype=torch.uint8)
        times = []
        for _ in range(plan.runs):
            t0 = time.perf_counter()
            for view in views:
                self.dist.send(view, dst=1)
            self.dist.recv(ack, src=1)
            times.append(time.perf_counter() - t0)
        return times

    def close(self) -> None:
        self.dist.destroy_process_group()


async def _transport_send(backend: str, conn: Any, plan: XferPlan, src: KVPool) -> list[float]:
    desc, region = await expect_target(conn)
    times = []
    async with _transport(backend, "bench-send") as t:
        local = t.register(src.raw)
        entries = block_entries(local, src, plan, region)
        async with await t.connect(desc) as ep:
            if (getattr(ep, "unix_path", None) is not None) != (backend == "tcp-unix"):
                raise RuntimeError(f"{backend}: the lanes went over the wrong socket")
            for run in range(plan.runs):
                t0 = time.perf_counter()
                await ep.write(entries, imm=run)
                times.append(time.perf_counter() - t0)
        t.deregister(local)
    return times


def bench_backend(backend: str, plans: list[XferPlan], warmup: int) -> list[Result]:
    """Run every plan through one backend; raises if any byte went missing."""
    if backend == "memcpy":
        out = []
        for plan in plans:
            times, ok = _memcpy_run(plan)
            _check(ok, backend, plan)
            out.append(Result(backend, plan.num_bytes, plan.num_bytes / min(times[warmup:]) / 1e9))
        return out
    sender: Any = None
    out = []
    with spawned("receiver", _receive, backend, plans) as conn:
        try:
            if backend in ("socket", "gloo"):
                sender = (_SocketSender if backend == "socket" else _GlooSender)(conn)
            for plan in plans:
                src = _source(plan)
                if sender is not None:
                    times = sender.run(plan, src)
                    crc, imms = _expect(conn, "done")
                else:
                    times = asyncio.run(_transport_send(backend, conn, plan, src))
                    crc, imms = _expect(conn, "done")
                    conn.send("closed")
                    if imms != list(range(plan.runs)):
                        raise RuntimeError(
                            f"{backend}: completions {imms}, expected imms 0..{plan.runs - 1} "
                            "in order"
                        )
                _check(crc == blocks_crc(src, plan.src_blocks), backend, plan)
                gbps = plan.num_bytes / min(times[warmup:]) / 1e9
                out.append(Result(backend, plan.num_bytes, gbps))
                del src
        finally:
            if sender is not None:
                sender.close()
    return out


def _check(ok: bool, backend: str, plan: XferPlan) -> None:
    if not ok:
        raise RuntimeError(
            f"{backend}: destination blocks differ from the source after moving {plan.num_bytes} bytes"
        )
