"""The set-up that tests/transport/test_transport_windows.py, tests/transport/test_transport_reads.py and
tests/transport/test_transport_rdma_windows.py share: a receiver whose pool of blocks is one registered
region, a peer connected to it that holds a block to write from, and windows over the pool's
blocks."""

from __future__ import annotations

import asyncio

from kvmesh.shared.transport import (
    Access,
    Completion,
    Endpoint,
    MemoryWindow,
    Transport,
    TransportConfig,
    WriteEntry,
    create_transport,
)
from kvmesh.shared.transport.rdma import RdmaTransport

from support.fake_pyverbs import FakeVerbs
from support.transport_wire import over_the_wire

BLOCK = 4096


def make_transport(backend: str, config: TransportConfig, verbs: FakeVerbs) -> Transport:
    """A transport of ``backend``; rdma runs on ``verbs`` (give both ends the same fabric)."""
    if backend == "rdma":
        return RdmaTransport(config, verbs=verbs)
    return create_transport(backend, config)


class PoolPair:
    """``rx`` with a zeroed pool ``mem`` of ``num_blocks`` blocks, registered as ``region`` with
    ``access``; ``tx`` holds one block of 0x5A (``src``, ``src_region``) and is connected to
    ``rx`` through ``ep`` (the descriptor as it travels). Subclasses extend ``setup`` to prepare
    more before the connection is made."""

    def __init__(
        self,
        rx: Transport,
        tx: Transport,
        num_blocks: int,
        access: Access = Access.REMOTE_WRITE,
    ) -> None:
        self._transports = (rx, tx)
        self.num_blocks = num_blocks
        self.access = access

    async def __aenter__(self) -> PoolPair:
        rx, tx = self._transports
        self.rx = await rx.__aenter__()
        self.tx = await tx.__aenter__()
        self.setup()
        self.ep = await self.connect()
        return self

    def setup(self) -> None:
        self.mem = self.rx.allocate(self.num_blocks * BLOCK)
        self.mem.zero_()
        self.region = self.rx.register(self.mem, self.access)
        self.src = self.tx.allocate(BLOCK)
        self.src.fill_(0x5A)
        self.src_region = self.tx.register(self.src)

    async def __aexit__(self, *exc: object) -> None:
        await self.ep.aclose()
        await self.tx.aclose()
        await self.rx.aclose()

    async def connect(self) -> Endpoint:
        """A further connection from ``tx`` to ``rx``."""
        return await self.tx.connect(over_the_wire(self.rx.descriptor()))

    def addr(self, block: int) -> int:
        return self.region.addr + block * BLOCK

    def window(self, *blocks: int, access: Access = Access.REMOTE_WRITE) -> MemoryWindow:
        return self.rx.open_window(self.region, [(self.addr(b), BLOCK) for b in blocks], access)

    async def write(self, block: int, rkey: int, imm: int = 7, ep: Endpoint | None = None) -> None:
        """Write ``src`` to ``block`` with ``rkey`` through ``ep`` (default: the pair's own)."""
        entry = WriteEntry(self.src_region, 0, self.addr(block), rkey, BLOCK)
        await asyncio.wait_for((ep or self.ep).write([entry], imm), 10)

    def written(self) -> list[int]:
        """The pool's blocks that are no longer zero."""
        blocks = self.mem.view(self.num_blocks, BLOCK)
        return [b for b in range(self.num_blocks) if bool(blocks[b].any())]

    async def completions(self, n: int) -> list[Completion]:
        return [await asyncio.wait_for(self.rx.completion_queue.get(), 5) for _ in range(n)]

    async def refused_after(self, expected: int) -> int:
        """The receiver's refused count once it has heard of (or seen) ``expected`` refusals, or
        after 5 s: refusals reach the receiver's count apart from the writer's error."""
        for _ in range(1000):
            if self.rx.stats().refused >= expected:
                break
            await asyncio.sleep(0.005)
        return self.rx.stats().refused
