"""``kvmesh admin`` as a user runs it (a real process) against a real registry and decode peer."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.nats_connect import connect_nats
from kvmesh.shared.bus.nats_request import request_json
from kvmesh.shared.bus.nats_server import NatsServer
from support.registry_peers import peer_decode, wait_for

from kvmesh.commands.admin import render_status, table

REPO = Path(__file__).resolve().parents[2]


async def kvmesh_admin(*argv: str, url: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "kvmesh.cli", "admin", *argv, "--nats-url", url),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_admin_commands_against_a_live_registry(nats_server: str) -> None:
    config = RegistryConfig(nats_url=nats_server, worker_id="reg-1", heartbeat_s=0.2)
    async with (
        registry_service(config),
        peer_decode(nats_server, "decode-a", total_blocks=64) as peer,
        connect_nats(nats_server, "test") as nc,
    ):

        async def registered() -> bool:
            status = await request_json(nc, "kvmesh.kvmesh-tiny.admin.status", {}, 2.0)
            return len(status["decode"]) == 1

        await wait_for(registered)

        rc, out, err = await kvmesh_admin("status", url=nats_server)
        assert rc == 0, err
        assert "kv-registry reg-1" in out
        row = next(line.split() for line in out.splitlines() if "decode-a" in line)
        assert row[:6] == ["decode-a", "decode", "ready", "64", "64", "0"]

        rc, out, err = await kvmesh_admin("status", "--json", url=nats_server)
        assert rc == 0, err
        status = json.loads(out)
        assert status["decode"][0]["pool"]["total_blocks"] == 64

        rc, out, _ = await kvmesh_admin("workers", url=nats_server)
        assert rc == 0 and "decode-a" in out and "reg-1" in out and "kv-registry" in out

        rc, out, err = await kvmesh_admin("drain", "decode-a", url=nats_server)
        assert rc == 0, err
        assert out.strip() == "drain sent to decode-a (now draining)"
        assert peer.controls == ["drain"] and peer.state == "draining"
        rc, _, err = await kvmesh_admin("resume", "decode-a", url=nats_server)
        assert rc == 0, err and peer.controls == ["drain", "resume"]

        rc, out, err = await kvmesh_admin("log-level", "warning", "--json", url=nats_server)
        assert rc == 0, err
        assert json.loads(out) == {"level": "warning", "ok": True}

        rc, _, err = await kvmesh_admin("drain", "nobody", url=nats_server)
        assert rc == 1 and "nobody" in err and "kvmesh admin workers" in err


async def test_admin_without_registry_says_what_to_start(nats_server: str) -> None:
    rc, _, err = await kvmesh_admin("status", url=nats_server)
    assert rc == 1 and "kvmesh serve kv-registry" in err


async def test_admin_without_nats_fails_fast_with_a_hint() -> None:
    server = NatsServer()
    await asyncio.to_thread(server.start)
    url = server.url
    await asyncio.to_thread(server.stop)  # a port nobody listens on any more
    rc, _, err = await kvmesh_admin("status", url=url)
    assert rc == 1 and "no NATS server answered" in err and "--nats-url" in err


def test_table_aligns_columns_and_handles_empty_rows() -> None:
    text = table([{"a": "x", "b": 10}, {"a": "long", "b": 2}], ("a", "b"))
    assert text.splitlines() == ["  a     b", "  x     10", "  long  2"]
    assert table([], ("a",)) == "  (none)"


def test_admin_status_text_says_degraded_when_an_optional_service_is_silent() -> None:
    status = {"registry": {"worker_id": "reg-0", "uptime_s": 5}}
    assert "degraded" not in render_status(status)
    text = render_status({**status, "degraded": ["kv-store (kv-store-0 silent)"]})
    assert text.splitlines()[1] == "degraded: kv-store (kv-store-0 silent)"


def test_the_workers_table_shows_each_workers_tensor_parallel_degree() -> None:
    from kvmesh.commands.admin import render

    rows = [
        {"worker_id": "prefill-0", "role": "prefill", "load": {"state": "ready"}, "tp": 2},
        {"worker_id": "decode-0", "role": "decode", "load": {"state": "ready"}, "tp": 1},
    ]
    header, *lines = render("workers", {"workers": rows}).splitlines()
    columns = ["worker_id", "role", "state", "tp", "num_running", "num_waiting", "last_seen_s"]
    assert header.split() == columns
    assert [line.split()[3] for line in lines] == ["2", "1"]
