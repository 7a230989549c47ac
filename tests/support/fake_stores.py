"""In-process stand-ins for a kv-store and the store book, as the decode worker's swaps use them."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvmesh.shared.mesh.kv_store_client import GetResult, LocalBlock, PutResult, StoreTarget


class FakeStore:
    """Blocks copied by hash in this process; ``fail_puts``: every put raises."""

    def __init__(self, raw, block_bytes: int, fail_puts: bool = False) -> None:
        self.raw, self.block_bytes, self.fail_puts = raw, block_bytes, fail_puts
        self.blocks: dict[int, bytes] = {}
        self.num_read = 0

    async def put(self, store, kv_spec: str, blocks: Sequence[LocalBlock]) -> PutResult:
        await asyncio.sleep(0)  # in flight for a moment, as a real put is
        if self.fail_puts:
            raise ConnectionError("store gone")
        present = tuple(b.block_hash for b in blocks if b.block_hash in self.blocks)
        for b in blocks:
            self.blocks[b.block_hash] = bytes(
                self.raw[b.offset : b.offset + self.block_bytes].numpy()
            )
        return PutResult(True, present, tuple(b.block_hash for b in blocks))

    async def get(self, store, kv_spec: str, blocks: Sequence[LocalBlock]) -> GetResult:
        n = 0
        for b in blocks:
            data = self.blocks.get(b.block_hash)
            if data is None:
                break
            self.raw[b.offset : b.offset + self.block_bytes].numpy()[:] = memoryview(data)
            n += 1
        self.num_read += n
        return GetResult(n, n)


class OneStore:
    """StoreBook's part that Swaps uses: one store, forgotten for good after a failure."""

    def __init__(self) -> None:
        self.live = True

    def target(self) -> StoreTarget | None:
        return StoreTarget("kv-store-0", None) if self.live else None  # type: ignore[arg-type]

    def forget(self, store_id: str) -> None:
        self.live = False
