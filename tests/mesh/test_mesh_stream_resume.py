"""A stream whose router dies (kill -9) is resumed through another router (real processes).

``kvmesh up --routers 2``: two routers on one port (SO_REUSEPORT). A greedy stream is read
until a few tokens arrived, then the router serving its connection (found by the socket's
owner) is killed; the client sends the same request with ``Last-Event-ID`` to the same port
(the kernel takes it to the live router) and reads the rest. The text as a whole is the offline
engine's, with no token lost or repeated, and the stream outlives the registry's announcement
that its first router is gone (the decode worker aborts that router's streams, not one another
router took over). Afterwards an unknown id is a 404 and the ended stream's id, once its grace
is over, a 410.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from kvmesh.services.router.stream_ids import EventId
from kvmesh.shared.bus.admin_client import admin_client

from kvmesh.testing.mesh import completion_body, launched, mesh_config
from kvmesh.testing.offline import offline_texts

pytestmark = pytest.mark.slow

MAX_TOKENS = 96
ENV = {
    "KVMESH_MIN_STEP_INTERVAL_MS": "50",  # a token every 50 ms: the kill lands mid-stream
    "KVMESH_HEARTBEAT_S": "0.5",  # a dead router is announced ~1.5 s after its death
    "KVMESH_RESUME_GRACE_S": "1",  # an ended stream's tokens are kept 1 s
}
PROMPT = list(range(11, 43))


@pytest.fixture(scope="module")
def mesh():
    config = mesh_config(mode="colocated", decode=1, routers=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # the idle answer, computed while the mesh starts
        want = pool.submit(offline_texts, [PROMPT], MAX_TOKENS, num_blocks=32)
        with launched(config, ENV) as launcher:
            launcher.want = want.result()[0]
            yield launcher


def _owner_of_server_end(client_port: int, server_port: int, pids: list[int]) -> int:
    """The pid (of ``pids``) whose socket is the server end of our connection."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = fields[1], fields[2]
            if int(local.rsplit(":", 1)[1], 16) == server_port and (
                int(remote.rsplit(":", 1)[1], 16) == client_port
            ):
                inode = fields[9]
    assert inode is not None, "no server socket for our connection"
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    raise AssertionError("no router holds our connection")


async def _read_events(resp: aiohttp.ClientResponse, events: list[tuple[str, dict | str]]):
    """SSE events as (id, data) until the stream ends (or breaks: the router died)."""
    event_id, data = "", None
    try:
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
            elif line == "" and data is not None:
                events.append((event_id, data if data == "[DONE]" else json.loads(data)))
                event_id, data = "", None
    except (aiohttp.ClientPayloadError, aiohttp.ClientOSError):  # cut mid-stream (EOF, reset)
        pass


def _text(events) -> str:
    return "".join(d["choices"][0]["text"] for _, d in events if d != "[DONE]" and d["choices"])


async def _kill_and_resume(mesh):
    body = completion_body(PROMPT, MAX_TOKENS, stream=True, ignore_eos=True)
    url = f"{mesh.url}/v1/completions"
    port = int(mesh.url.rsplit(":", 1)[1])
    routers = {name: proc for name, (spec, proc) in mesh.children.items() if spec.tier == "router"}
    first: list = []
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url, json=body)
        assert resp.status == 200
        client_port = resp.connection.transport.get_extra_info("sockname")[1]
        reader = asyncio.create_task(_read_events(resp, first))
        while sum(1 for _, d in first if d != "[DONE]" and d["choices"]) < 5:
            await asyncio.sleep(0.02)
        pid = _owner_of_server_end(client_port, port, [p.pid for p in routers.values()])
        killed = next(name for name, p in routers.items() if p.pid == pid)
        os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(reader, 10)
        assert first[-1][1] != "[DONE]"  # it broke
        last_id = first[-1][0]
        rest: list = []
        headers = {"Last-Event-ID": last_id}
        async with (
            admin_client(
                mesh.config.nats_url, timeout_s=2.0, auth=mesh.nats_auth, mesh=mesh.mesh
            ) as admin,
            session.post(url, json=body, headers=headers) as again,
        ):
            assert again.status == 200, await again.text()
            reader = asyncio.create_task(_read_events(again, rest))
            # the registry announces the dead router while the resumed stream still runs
            announced_at_events = None
            while not reader.done():
                workers = {w.worker_id for w in await admin.workers()}
                if announced_at_events is None and killed not in workers:
                    announced_at_events = len(rest)
                await asyncio.sleep(0.1)
            await reader
        return first, rest, last_id, announced_at_events


def test_a_stream_resumed_through_another_router_loses_no_token(mesh):
    want = mesh.want
    first, rest, last_id, announced_at = asyncio.run(_kill_and_resume(mesh))
    assert last_id.startswith("cmpl-") and last_id.count(":") == 2
    assert _text(first) + _text(rest) == want
    assert rest[-1][1] == "[DONE]" and rest[-2][1]["choices"][0]["finish_reason"] == "length"
    last = EventId.parse(last_id, "completion")
    resumed = [EventId.parse(i, "completion") for i, _ in rest]  # every event has an id
    assert all(e.request_id == last.request_id for e in resumed)
    assert [e.point for e in resumed] == sorted(e.point for e in resumed)
    assert resumed[0].point > last.point
    # the resumed stream was still sending when its first router was announced gone
    assert announced_at is not None and announced_at < len(rest) - 2

    async def ask(last_event_id: str) -> tuple[int, dict]:
        body = completion_body(PROMPT, MAX_TOKENS, stream=True, ignore_eos=True)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{mesh.url}/v1/completions", json=body, headers={"Last-Event-ID": last_event_id}
            ) as resp,
        ):
            return resp.status, await resp.json()

    status, error = asyncio.run(ask("cmpl-" + "0" * 24 + ":3:0"))
    assert status == 404 and error["error"]["code"] == "stream_not_found"
    time.sleep(1.5)  # past the ended stream's grace
    status, error = asyncio.run(ask(rest[-2][0]))
    assert status == 410 and error["error"]["code"] == "stream_expired"
