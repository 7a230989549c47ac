"""The two ends of ``kvmesh bench kv``: a spawned owner process holding the remote pool, and this
process writing blocks into it and reading them back one-sided (the torch side of the benchmark).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time
from typing import Any

import torch
from kvmesh.loadgen.bench_kv import KvResult
from kvmesh.loadgen.bench_xfer import Plan
from kvmesh.loadgen.xfer_backends import SPEC, _expect, _source, blocks_crc
from kvmesh.shared.kv.kv_cache import KVPool

_TIMEOUT_S = 600.0


def _owner_main(conn: Any, backend: str, plans: list[Plan]) -> None:
    torch.set_num_threads(1)
    try:
        asyncio.run(_owner(conn, backend, plans))
    except BaseException as exc:
        conn.send(("error", f"{backend} owner: {exc!r}"))
        raise


async def _owner(conn: Any, backend: str, plans: list[Plan]) -> None:
    """Holds each plan's pool behind one read+write window; its code does nothing per read."""
    from kvmesh.shared.transport import Access, TransportConfig, create_transport

    for plan in plans:
        async with create_transport(backend, TransportConfig(peer_id="bench-owner")) as t:
            pool = KVPool(
                SPEC, plan.pool_blocks, buffer=t.allocate(plan.pool_blocks * SPEC.block_bytes)
            )
            region = t.register(pool.raw, Access.REMOTE)
            window = t.open_window(region, [(region.addr, region.length)], Access.REMOTE)
            target = dataclasses.replace(region, rkey=window.rkey)
            conn.send(("ready", (t.descriptor().to_dict(), target.to_dict())))
            for _ in range(plan.runs):  # the writes' completions; reads deliver none
                await asyncio.wait_for(t.completion_queue.get(), _TIMEOUT_S)
            await asyncio.to_thread(conn.recv)  # the reader has closed its endpoint
            conn.send(("done", blocks_crc(pool, plan.dst_blocks), None))
            t.close_window(window)
            t.deregister(region)
            del pool


async def _write_then_read(
    backend: str, conn: Any, plan: Plan, src: KVPool, back: KVPool
) -> tuple[list[float], list[float]]:
    from kvmesh.shared.transport import (
        MemoryRegion,
        PeerDescriptor,
        TransportConfig,
        WriteEntry,
        create_transport,
    )

    desc, region = await asyncio.to_thread(_expect, conn, "ready")
    desc, region = PeerDescriptor.from_dict(desc), MemoryRegion.from_dict(region)
    writes, reads = [], []
    async with create_transport(backend, TransportConfig(peer_id="bench-reader")) as t:
        local, landing = t.register(src.raw), t.register(back.raw)

        def entries(mr: MemoryRegion) -> list[WriteEntry]:
            return [
                WriteEntry(
                    mr,
                    src.block_offset(s),
                    region.addr + d * SPEC.block_bytes,
                    region.rkey,
                    SPEC.block_bytes,
                )
                for s, d in zip(plan.src_blocks, plan.dst_blocks, strict=True)
            ]

        out, home = entries(local), entries(landing)
        async with await t.connect(desc) as ep:
            for run in range(plan.runs):
                t0 = time.perf_counter()
                await ep.write(out, imm=run)
                writes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await ep.read(home)
                reads.append(time.perf_counter() - t0)
        t.deregister(local)
        t.deregister(landing)
    return writes, reads


def bench_read_write(backend: str, plans: list[Plan], warmup: int) -> list[KvResult]:
    """Every plan through one backend; raises if a byte read back differs from the source."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_owner_main, args=(child_conn, backend, plans), daemon=True)
    proc.start()
    child_conn.close()
    out = []
    try:
        for plan in plans:
            src, back = _source(plan), KVPool(SPEC, plan.pool_blocks)
            writes, reads = asyncio.run(_write_then_read(backend, conn, plan, src, back))
            conn.send("closed")
            crc = _expect(conn, "done")[0]
            want = blocks_crc(src, plan.src_blocks)
            if crc != want or blocks_crc(back, plan.src_blocks) != want:
                raise RuntimeError(
                    f"{backend}: blocks differ from the source after writing and reading back "
                    f"{plan.num_bytes} bytes"
                )
            n = plan.num_bytes
            out.append(
                KvResult(backend, n, n / min(writes[warmup:]) / 1e9, n / min(reads[warmup:]) / 1e9)
            )
            del src, back
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.terminate()
            proc.join()
    return out
