"""A small decode worker speaking the real protocol over NATS, for the registry and admin tests.

It owns a free list, reserves blocks under leases it enforces (frees them when the lease runs out
before a PrefillDone), answers drain/resume, and advertises its state every ``interval_s``: what
the registry needs from ``services/decode`` without loading a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import LeaseCancel, ReserveReply, ReserveRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.workers import (
    BlockPool,
    DecodeAdvert,
    DecodeReach,
    WorkerControl,
    WorkerHeartbeat,
    WorkerLoad,
)
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.service_lifetime import background
from kvmesh.shared.bus.worker_presence import publish_every
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.kv.descriptor import TcpBackend, TransportDescriptor
from nats.aio.client import Client
from nats.aio.msg import Msg

SECRET = "ab" * 32  # a tcp descriptor's lane secret (64 hex digits)

BLOCK_SIZE = 16
BLOCK_BYTES = 4096


@dataclass
class PeerDecode:
    nc: Client
    worker_id: str
    total_blocks: int = 32
    base_addr: int = 1 << 30
    mode: str = "disagg"
    state: str = "ready"
    refuse_with: str = ""  # non-empty: refuse every reservation with this error
    is_silent: bool = False  # never answer a reservation (a stopped worker)
    cancels: list[LeaseCancel] = field(default_factory=list)
    free: list[int] = field(default_factory=list)
    leases: dict[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)
    reserves: list[ReserveRequest] = field(default_factory=list)
    controls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free = list(range(self.total_blocks))

    def advert(self) -> DecodeAdvert:
        return DecodeAdvert(
            worker_id=self.worker_id,
            mode=self.mode,
            reach=DecodeReach(
                descriptor=TransportDescriptor(
                    self.worker_id, "h", (TcpBackend("127.0.0.1", 1, SECRET),)
                ),
                block_bytes=BLOCK_BYTES,
                block_size=BLOCK_SIZE,
                kv_spec="test-spec",
            ),
            load=WorkerLoad(self.state, num_running=len(self.leases), num_waiting=0),
            pool=BlockPool(
                total_blocks=self.total_blocks,
                free_blocks=len(self.free),
                free_block_ranges=tuple((b, b + 1) for b in sorted(self.free)),
            ),
            sent_at=time.time(),
        )

    async def on_reserve(self, msg: Msg) -> None:
        req = decode_message(msg.data, ReserveRequest)
        self.reserves.append(req)
        if self.is_silent:
            return
        need = -(-len(req.prompt_ids) // BLOCK_SIZE)
        if self.refuse_with or self.state != "ready" or need > len(self.free):
            error = self.refuse_with or f"{self.worker_id} cannot take {need} blocks"
            await msg.respond(encode_message(ReserveReply(False, self.worker_id, error=error)))
            return
        blocks = tuple(self.free[:need])
        del self.free[:need]
        self.leases[req.lease_id] = (blocks, time.monotonic() + req.lease_ms / 1000)
        addrs = tuple(self.base_addr + b * BLOCK_BYTES for b in blocks)
        reply = ReserveReply(True, self.worker_id, block_ids=blocks, rkey=42, block_addrs=addrs)
        await msg.respond(encode_message(reply))

    async def on_lease_cancel(self, msg: Msg) -> None:
        self.cancels.append(decode_message(msg.data, LeaseCancel))

    async def on_prefill_done(self, msg: Msg) -> None:
        done = decode_message(msg.data, PrefillDone)
        blocks, _ = self.leases.pop(done.lease_id, ((), 0.0))
        self.free.extend(blocks)

    async def on_control(self, msg: Msg) -> None:
        action = decode_message(msg.data, WorkerControl).action
        self.controls.append(action)
        self.state = "draining" if action == "drain" else "ready"
        beat = WorkerHeartbeat(
            worker_id=self.worker_id,
            role="decode",
            load=WorkerLoad(self.state),
            sent_at=time.time(),
        )
        await msg.respond(encode_message(beat))

    async def lease_loop(self) -> None:
        while True:
            now = time.monotonic()
            for lease_id, (blocks, deadline) in list(self.leases.items()):
                if deadline <= now:
                    del self.leases[lease_id]
                    self.free.extend(blocks)
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def peer_decode(
    url: str, worker_id: str, *, interval_s: float = 0.1, mesh: str = DEFAULT_MESH, **kw: object
) -> AsyncIterator[PeerDecode]:
    """Run a PeerDecode of mesh ``mesh`` on its own connection until the block exits (then it
    goes silent)."""
    subjects = Subjects(mesh)
    async with connect_nats(url, worker_id) as nc:
        peer = PeerDecode(nc, worker_id, **kw)  # type: ignore[arg-type]
        subs = [
            await nc.subscribe(subjects.decode_reserve(worker_id), cb=peer.on_reserve),
            await nc.subscribe(subjects.decode_prefill_done(worker_id), cb=peer.on_prefill_done),
            await nc.subscribe(subjects.worker_control(worker_id), cb=peer.on_control),
            await nc.subscribe(subjects.decode_lease_cancel(worker_id), cb=peer.on_lease_cancel),
        ]
        async with background(
            publish_every(nc, subjects.REGISTRY_ADVERTISE, peer.advert, interval_s),
            peer.lease_loop(),
        ):
            await flush_to_server(nc)
            yield peer
        for sub in subs:
            await sub.unsubscribe()


async def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.02
) -> None:
    """Poll an (async or sync) predicate until it is truthy; fail the test after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
