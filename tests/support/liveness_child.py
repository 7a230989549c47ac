"""A worker for tests/workers/test_liveness.py, run as its own process: it joins the mesh with
``worker_presence`` (heartbeats from the liveness beacon's thread) as a prefill worker, and
blocks its event loop on request (``test.block.<id>``, the data a file's path) with time.sleep
until that file exists, as a slow handler would.

    python liveness_child.py NATS_URL WORKER_ID INTERVAL_S STALL_LIMIT_S
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from kvmesh.shared.bus.messages.workers import WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.worker_presence import worker_presence
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects


async def main(url: str, worker_id: str, interval_s: float, stall_limit_s: float) -> None:
    started_at = time.time()

    def beat() -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=worker_id, role="prefill", load=WorkerLoad("ready"), started_at=started_at
        )

    async with (
        connect_nats(url, worker_id) as nc,
        worker_presence(
            nc,
            Subjects(DEFAULT_MESH),
            role="prefill",
            worker_id=worker_id,
            heartbeat=beat,
            interval_s=interval_s,
            stall_limit_s=stall_limit_s,
        ),
    ):

        async def block(msg) -> None:
            await msg.respond(b"blocking")
            await nc.flush()
            release = Path(msg.data.decode())
            while not release.exists():  # the whole loop waits: no task of it runs
                time.sleep(0.02)

        await nc.subscribe(f"test.block.{worker_id}", cb=block)
        await nc.flush()
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    url, worker_id, interval, limit = sys.argv[1:5]
    asyncio.run(main(url, worker_id, float(interval), float(limit)))
