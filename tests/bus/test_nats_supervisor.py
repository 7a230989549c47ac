"""`kvmesh up`'s nats-server supervision: a killed server is reaped, logged and restarted on its
port with its config and JetStream store, within the restart budget (a real nats-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from kvmesh.shared.bus.nats_server import NatsServer, NatsServerError, nats_is_reachable

from kvmesh.commands.nats_supervisor import NatsSupervisor
from kvmesh.commands.restarts import RestartPolicy


def _kill(server: NatsServer) -> None:
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while server.exit_code() is None or nats_is_reachable(server.url, timeout_s=0.2):
        assert time.monotonic() < deadline
        time.sleep(0.01)


async def _file_stream_messages(url: str, publish: bool) -> int:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if publish:
            await js.add_stream(name="KEPT", subjects=["kept.>"], storage="file")
            await js.publish("kept.a", b"survives")
        return (await js.stream_info("KEPT")).state.messages
    finally:
        await nc.close()


def test_a_killed_nats_server_is_restarted_on_its_port_with_its_jetstream_store():
    lines: list[str] = []
    with NatsServer() as server:
        url, store = server.url, server.state_dir
        assert asyncio.run(_file_stream_messages(url, publish=True)) == 1
        policy = RestartPolicy(max_restarts=3, first_delay_s=0.2)
        supervisor = NatsSupervisor(server, policy, say=lines.append)
        supervisor.check(time.monotonic())
        assert lines == []  # running: nothing to do
        old_pid = server.pid
        _kill(server)
        killed = time.monotonic()
        supervisor.check(killed)  # reaps it and schedules the restart
        assert server.exit_code() == -9 and server.pid == old_pid
        assert "nats-server exited with code -9; restarting it in 0.2 s" in lines[0]
        supervisor.check(killed + 0.1)  # backoff not over
        assert len(lines) == 1
        supervisor.check(killed + 0.3)
        assert lines[1].startswith(f"kvmesh up: restarted nats-server at {url}")
        assert server.url == url and server.pid != old_pid and server.state_dir == store
        assert server.exit_code() is None and supervisor.num_restarts == 1
        assert asyncio.run(_file_stream_messages(url, publish=False)) == 1  # the store was kept


def test_a_nats_server_that_dies_more_often_than_the_budget_stops_the_mesh():
    with NatsServer() as server:
        supervisor = NatsSupervisor(
            server, RestartPolicy(max_restarts=1, first_delay_s=0.0), say=lambda _: None
        )
        _kill(server)
        supervisor.check(time.monotonic())  # the first death: restarted at once
        assert server.exit_code() is None
        _kill(server)
        with pytest.raises(NatsServerError, match="exited with code -9, 2 times"):
            supervisor.check(time.monotonic())
