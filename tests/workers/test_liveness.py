"""Heartbeats a slow request cannot starve (issue 40, shared/bus/liveness.py): they come from a
thread with its own NATS connection, so a worker whose event loop is blocked for many heartbeat
periods (time.sleep in a handler) goes on beating and stays in the mesh; a loop silent past the
stall limit stops them, and a stopped process (SIGSTOP) beats from no thread: both are dropped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.liveness import LivenessBeacon
from kvmesh.shared.bus.messages.codec import decode_message
from kvmesh.shared.bus.messages.workers import WorkerGone, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.nats_request import request_json
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.config.worker_config import ServiceConfig
from nats.aio.client import Client
from support.adverts import with_fields
from support.registry_peers import wait_for

CHILD = Path(__file__).parents[1] / "support" / "liveness_child.py"
subjects = Subjects(DEFAULT_MESH)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def never_opened():  # the pure tests never start the thread
    raise AssertionError("no connection in a pure test")


def test_the_beacon_beats_the_latest_record_until_the_loop_is_silent_past_the_limit() -> None:
    clock = Clock()
    first = WorkerHeartbeat(
        worker_id="w", role="prefill", load=WorkerLoad("ready", num_running=1), sent_at=1.0
    )
    beacon = LivenessBeacon(
        never_opened, "hb", first, interval_s=1.0, stall_limit_s=5.0, clock=clock
    )
    beat = beacon.due()
    assert beat is not None and beat.load.num_running == 1 and beat.sent_at > 1.0  # sent now
    clock.now += 4.9  # the loop is busy (no record for 4.9 periods): the thread beats for it
    assert beacon.due() is not None
    beacon.record(with_fields(first, state="draining"))
    clock.now += 5.0
    beat = beacon.due()
    assert beat is not None and beat.load.state == "draining"  # the loop's latest word
    clock.now += 0.1  # 5.1 s without a record: the loop is taken for dead
    assert beacon.due() is None
    clock.now += 60.0
    assert beacon.due() is None
    beacon.record(first)  # it runs again
    assert beacon.due() is not None


def test_a_stall_limit_not_above_the_interval_is_refused() -> None:
    first = WorkerHeartbeat(worker_id="w", role="prefill", load=WorkerLoad("ready"))
    with pytest.raises(ValueError, match="stall limit"):
        LivenessBeacon(never_opened, "hb", first, interval_s=2.0, stall_limit_s=2.0)
    with pytest.raises(ValueError, match="loop_stall_limit_s"):
        ServiceConfig(heartbeat_s=2.0, loop_stall_limit_s=1.0)


def start_child(url: str, worker_id: str, stall_limit_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), url, worker_id, "0.1", str(stall_limit_s)],
        stdout=subprocess.PIPE,
        text=True,
    )


async def listed(nc: Client, worker_id: str) -> bool:
    rows = (await request_json(nc, subjects.ADMIN_WORKERS, {}, 5.0))["workers"]
    return worker_id in {row["worker_id"] for row in rows}


async def test_a_blocked_loop_keeps_beating_a_wedged_or_stopped_worker_is_dropped(
    nats_server: str, tmp_path: Path
) -> None:
    # a 3 s window (30 missed beats of 0.1 s): a loaded box may stall a process for a while
    config = RegistryConfig(nats_url=nats_server, heartbeat_s=0.1, missed_heartbeats=30)
    busy = start_child(nats_server, "prefill-busy", stall_limit_s=2.0)
    stopped = start_child(nats_server, "prefill-stopped", stall_limit_s=30.0)
    try:
        async with registry_service(config), connect_nats(nats_server, "test") as nc:
            beats: asyncio.Queue[WorkerHeartbeat] = asyncio.Queue()
            gone: dict[str, asyncio.Event] = {
                w: asyncio.Event() for w in ("prefill-busy", "prefill-stopped")
            }

            async def on_beat(msg) -> None:
                beats.put_nowait(decode_message(msg.data, WorkerHeartbeat))

            async def on_gone(msg) -> None:
                worker_id = decode_message(msg.data, WorkerGone).worker_id
                if worker_id in gone:
                    gone[worker_id].set()

            await nc.subscribe(subjects.heartbeat("prefill", "prefill-busy"), cb=on_beat)
            await nc.subscribe(subjects.REGISTRY_WORKER_GONE, cb=on_gone)
            for worker_id in gone:
                await wait_for(lambda w=worker_id: listed(nc, w), timeout_s=60.0)

            # its loop blocked in a handler (time.sleep) for as long as it takes to hear three
            # heartbeats: they come from the beacon's thread, and the registry keeps it
            release = tmp_path / "release-busy"
            reply = await nc.request("test.block.prefill-busy", str(release).encode(), timeout=30)
            assert reply.data == b"blocking"
            while not beats.empty():
                beats.get_nowait()
            for _ in range(3):
                await asyncio.wait_for(beats.get(), 30.0)
            assert await listed(nc, "prefill-busy") and not gone["prefill-busy"].is_set()
            release.touch()

            # a stopped process beats from no thread, and a loop wedged past its stall limit
            # (2 s) stops its thread's beats: both are dropped
            os.kill(stopped.pid, signal.SIGSTOP)
            wedged = tmp_path / "release-wedged"
            await nc.request("test.block.prefill-busy", str(wedged).encode(), timeout=30)
            for event in gone.values():
                await asyncio.wait_for(event.wait(), 60.0)
            wedged.touch()
    finally:
        for child in (busy, stopped):
            child.kill()  # a stopped process too
            child.wait(10)
