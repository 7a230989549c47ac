"""The two ends of ``kvmesh bench kv``: a spawned owner process holding the remote pool, and this
process writing blocks into it and reading them back one-sided (the torch side of the benchmark).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvmesh.loadgen.bench_kv import KvResult
from kvmesh.loadgen.bench_xfer import XferPlan
from kvmesh.loadgen.xfer_backends import (
    SPEC,
    _expect,
    _source,
    block_entries,
    blocks_crc,
    expect_target,
    exposed_pool,
    spawned,
)
from kvmesh.shared.kv.kv_cache import KVPool

_TIMEOUT_S = 600.0


def _own(conn: Any, backend: str, plans: list[XferPlan]) -> None:
    asyncio.run(_owner(conn, backend, plans))


async def _owner(conn: Any, backend: str, plans: list[XferPlan]) -> None:
    """Holds each plan's pool behind one read+write window; its code does nothing per read."""
    from kvmesh.shared.transport import Access, TransportConfig, create_transport

    for plan in plans:
        async with create_transport(backend, TransportConfig(peer_id="bench-owner")) as t:
            with exposed_pool(t, conn, plan, Access.REMOTE) as pool:
                for _ in range(plan.runs):  # the writes' completions; reads deliver none
                    await asyncio.wait_for(t.completion_queue.get(), _TIMEOUT_S)
                await asyncio.to_thread(conn.recv)  # the reader has closed its endpoint
                conn.send(("done", blocks_crc(pool, plan.dst_blocks), None))
            del pool


async def _write_then_read(
    backend: str, conn: Any, plan: XferPlan, src: KVPool, back: KVPool
) -> tuple[list[float], list[float]]:
    from kvmesh.shared.transport import TransportConfig, create_transport

    desc, region = await expect_target(conn)
    writes, reads = [], []
    # "tcp" is TCP over loopback here, not the same-host unix socket (unix_lanes)
    config = TransportConfig(peer_id="bench-reader", tcp_unix_lanes=False)
    async with create_transport(backend, config) as t:
        local, landing = t.register(src.raw), t.register(back.raw)
        out = block_entries(local, src, plan, region)
        home = block_entries(landing, src, plan, region)  # back has src's layout
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


def bench_read_write(backend: str, plans: list[XferPlan], warmup: int) -> list[KvResult]:
    """Every plan through one backend; raises if a byte read back differs from the source."""
    out = []
    with spawned("owner", _own, backend, plans) as conn:
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
    return out
