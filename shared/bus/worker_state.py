"""What a worker says of its state in its heartbeats and adverts, and the admin tables show.

One enum for every role (decode, prefill, draft, kv-store, router, registry): a worker is
``STARTING`` from its first heartbeat until it can serve (a decode worker loading its model:
not placeable yet, but coming, so routers wait for it rather than refuse), then ``READY``, or
``DRAINING`` once ``kvmesh admin drain`` told it to take no new work (it finishes what it holds;
``resume`` makes it ready again). A ``StrEnum``: on the wire and in tables it is its value.
"""

from __future__ import annotations

import enum


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"

    @classmethod
    def of(cls, is_draining: bool) -> WorkerState:
        """A serving worker's state: draining, or ready."""
        return cls.DRAINING if is_draining else cls.READY
