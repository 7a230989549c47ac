"""StoreBook: the kv-stores a worker may use, from their adverts, and the one it reads and writes
(docs/kv_store.md, "Which store a worker reads").
"""

from __future__ import annotations

import time

from kvmesh.shared.bus.messages.kv_store import StoreAdvert
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.mesh.kv_store_client import StoreTarget

STORE_ADVERT_TTL_S = 5.0  # a store not heard of for this long is not asked


class StoreBook:
    """The stores a worker may use: the latest ``StoreAdvert`` of each store of its KV layout
    and block size (others could hold none of its blocks)."""

    def __init__(self, kv_spec: str, block_bytes: int, clock=time.monotonic) -> None:
        self.kv_spec = kv_spec
        self.block_bytes = block_bytes
        self.clock = clock
        self._stores: dict[str, tuple[StoreAdvert, float]] = {}

    def note(self, advert: StoreAdvert) -> None:
        if advert.reach.kv_spec == self.kv_spec and advert.reach.block_bytes == self.block_bytes:
            self._stores[advert.store_id] = (advert, self.clock())

    def forget(self, store_id: str) -> None:
        """A request to the store failed: leave it out until its next advert (a live store
        advertises every heartbeat), so that one dead store delays one request, not every one."""
        self._stores.pop(store_id, None)

    def target(self) -> StoreTarget | None:
        """The ready store with the lowest id among those heard of lately (each store holds what
        was put to it, so all workers of a mesh pick the same one)."""
        now = self.clock()
        live = sorted(
            (
                a
                for a, seen in self._stores.values()
                if now - seen <= STORE_ADVERT_TTL_S and a.load.state == WorkerState.READY
            ),
            key=lambda a: a.store_id,
        )
        if not live:
            return None
        return StoreTarget(live[0].store_id, live[0].reach.descriptor)
