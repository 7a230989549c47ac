"""The kv-registry against a real nats-server and real protocol peers (tests/support/registry_peers.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import nats.errors
import orjson
import pytest
from kvmesh.services.kv_registry.config import RegistryConfig
from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.admin_client import AdminError, admin_client
from kvmesh.shared.bus.messages.admin import (
    AdminControlled,
    AdminFailure,
    AdminLogLevelSet,
    AdminStatus,
    AdminWorkers,
)
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import PlaceReply, PlaceRequest
from kvmesh.shared.bus.messages.prefill_jobs import PrefillDone
from kvmesh.shared.bus.messages.workers import LogLevel, WorkerHeartbeat, WorkerLoad
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, connect_nats, flush_to_server
from kvmesh.shared.bus.nats_request import request_json
from kvmesh.shared.bus.worker_presence import heartbeat_loop
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.obs import logs
from kvmesh.shared.text.sampling import SamplingOptions
from nats.aio.client import Client
from nats.aio.msg import Msg
from support.proc_tree import reaped
from support.registry_peers import BLOCK_BYTES, peer_decode, wait_for

REPO = Path(__file__).resolve().parents[2]
subjects = Subjects(DEFAULT_MESH)  # RegistryConfig's default mesh


def config(url: str, **kw: object) -> RegistryConfig:
    # a 1 s liveness window: a loaded box may stall the one process the registry and its peers
    # share for longer than 3 intervals (every worker, the registry too, was once dropped at once)
    fields = dict(nats_url=url, heartbeat_s=0.1, missed_heartbeats=10, reserve_timeout_s=1.0)
    fields.update(kw)
    return RegistryConfig(**fields)  # type: ignore[arg-type]


def place_request(request_id: str, num_tokens: int = 40, **kw: object) -> PlaceRequest:
    fields = dict(
        request_id=request_id,
        prompt_ids=tuple(range(num_tokens)),
        sampling=SamplingOptions(max_tokens=4),
        local_prefill=False,
        lease_ms=5_000,
    )
    fields.update(kw)
    return PlaceRequest(**fields)  # type: ignore[arg-type]


async def place(nc: Client, request: PlaceRequest, timeout_s: float = 3.0) -> PlaceReply:
    msg = await nc.request(subjects.REGISTRY_PLACE, encode_message(request), timeout=timeout_s)
    return decode_message(msg.data, PlaceReply)


async def num_decode(nc: Client) -> int:
    return len((await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0))["decode"])


async def test_place_reserves_blocks_on_the_decode_worker_and_returns_addresses(
    nats_server: str,
) -> None:
    async with (
        registry_service(config(nats_server)),
        peer_decode(nats_server, "d1", base_addr=1 << 30) as d1,
        connect_nats(nats_server, "client") as nc,
    ):
        await wait_for(lambda: num_decode(nc))
        reply = await place(nc, place_request("r1", num_tokens=40))
        assert reply.ok, reply.error
        assert reply.worker_id == "d1" and reply.rkey == 42 and reply.block_bytes == BLOCK_BYTES
        assert reply.block_ids == (0, 1, 2)  # 40 tokens, 16 per block
        assert reply.block_addrs == tuple((1 << 30) + b * BLOCK_BYTES for b in (0, 1, 2))
        assert reply.descriptor.peer_id == "d1"
        (sent,) = d1.reserves
        assert sent.lease_id == reply.lease_id and sent.lease_ms == 5_000
        assert d1.free == list(range(3, 32))
        status = await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0)
        assert status["leases"]["active"] == 1
        # the prefill completes: the registry sees PrefillDone and closes the lease
        done = PrefillDone(request_id="r1", lease_id=reply.lease_id, ok=True, first_token=5)
        await nc.publish(subjects.decode_prefill_done("d1"), encode_message(done))

        async def lease_closed() -> bool:
            leases = (await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0))["leases"]
            return leases["active"] == 0 and leases["completed"] == 1

        await wait_for(lease_closed)


async def test_place_spreads_load_and_skips_a_refusing_worker(nats_server: str) -> None:
    async with (
        registry_service(config(nats_server)),
        peer_decode(nats_server, "bad", refuse_with="disk on fire") as bad,
        peer_decode(nats_server, "good") as good,
        connect_nats(nats_server, "client") as nc,
    ):
        await wait_for(lambda: _count(nc, 2))
        for i in range(4):
            reply = await place(nc, place_request(f"r{i}", num_tokens=16))
            assert reply.ok and reply.worker_id == "good", reply
        assert len(good.reserves) == 4
        assert len(bad.reserves) >= 1  # tried, refused, then the other worker took it


async def test_a_reservation_given_up_on_is_cancelled_on_its_worker(nats_server: str) -> None:
    async with (
        registry_service(config(nats_server, reserve_timeout_s=0.3)),
        peer_decode(nats_server, "stopped", is_silent=True) as stopped,
        peer_decode(nats_server, "good") as good,
        connect_nats(nats_server, "client") as nc,
    ):
        await wait_for(lambda: _count(nc, 2))
        for i in range(3):  # the least loaded worker is tried first: some go to "stopped"
            reply = await place(nc, place_request(f"r{i}", num_tokens=16))
            assert reply.ok and reply.worker_id == "good", reply
        assert stopped.reserves
        # each reservation "stopped" never answered is cancelled there, by its lease id
        await wait_for(lambda: len(stopped.cancels) == len(stopped.reserves))
        assert [c.lease_id for c in stopped.cancels] == [r.lease_id for r in stopped.reserves]
        assert all("no reserve reply" in c.reason for c in stopped.cancels)
        assert not good.cancels


async def test_place_replies_overloaded_when_no_worker_has_room(nats_server: str) -> None:
    async with (
        registry_service(config(nats_server, retry_after_s=0.25)),
        peer_decode(nats_server, "small", total_blocks=2),
        connect_nats(nats_server, "client") as nc,
    ):
        await wait_for(lambda: num_decode(nc))
        assert (await place(nc, place_request("fits", num_tokens=32))).ok
        reply = await place(nc, place_request("no-room", num_tokens=32))
        assert not reply.ok and reply.retry_after_s == 0.25
        assert reply.request_id == "no-room" and "full" in reply.error


async def test_place_without_decode_workers_is_a_clear_retryable_error(nats_server: str) -> None:
    async with registry_service(config(nats_server)), connect_nats(nats_server, "c") as nc:
        reply = await place(nc, place_request("r1"))
        assert not reply.ok and reply.retry_after_s > 0
        assert "no live decode workers" in reply.error


async def test_malformed_place_request_gets_an_error_reply(nats_server: str) -> None:
    async with registry_service(config(nats_server)), connect_nats(nats_server, "c") as nc:
        msg = await nc.request(subjects.REGISTRY_PLACE, b'{"request_id": "x"}', timeout=2)
        reply = decode_message(msg.data, PlaceReply)
        assert not reply.ok and reply.request_id == "x" and "missing field" in reply.error


async def test_silent_decode_worker_is_dropped_after_missed_heartbeats(nats_server: str) -> None:
    liveness = config(nats_server, missed_heartbeats=3)
    async with registry_service(liveness), connect_nats(nats_server, "c") as nc:
        async with peer_decode(nats_server, "short-lived"):
            await wait_for(lambda: num_decode(nc))
        started = time.monotonic()
        await wait_for(lambda: _count(nc, 0), timeout_s=3.0)
        assert time.monotonic() - started >= 0.2  # 3 missed intervals of 0.1 s, not at once


async def test_admin_status_and_workers_include_heartbeating_peers(nats_server: str) -> None:
    beat = lambda: WorkerHeartbeat(
        worker_id="prefill-1", role="prefill", load=WorkerLoad("ready", num_running=2)
    )
    async with (
        registry_service(config(nats_server, worker_id="reg-1")),
        peer_decode(nats_server, "d1"),
        connect_nats(nats_server, "c") as nc,
    ):
        task = asyncio.create_task(heartbeat_loop(nc, subjects, "prefill", "prefill-1", beat, 0.1))
        try:

            async def all_seen() -> bool:
                rows = (await request_json(nc, subjects.ADMIN_WORKERS, {}, 2.0))["workers"]
                return {"d1", "prefill-1", "reg-1"} <= {r["worker_id"] for r in rows}

            await wait_for(all_seen)
            status = await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0)
        finally:
            task.cancel()
        (d1,) = status["decode"]
        assert d1["pool"]["total_blocks"] == 32 and d1["pool"]["free_blocks"] == 32
        assert d1["load"]["state"] == "ready"
        prefill = next(w for w in status["workers"] if w["worker_id"] == "prefill-1")
        assert prefill["role"] == "prefill" and prefill["load"]["num_running"] == 2
        assert status["registry"]["worker_id"] == "reg-1"


async def test_admin_drain_and_resume_reach_the_worker_and_steer_placement(
    nats_server: str,
) -> None:
    async with (
        registry_service(config(nats_server)),
        peer_decode(nats_server, "d1") as d1,
        connect_nats(nats_server, "c") as nc,
    ):
        await wait_for(lambda: num_decode(nc))
        drained = await request_json(nc, subjects.ADMIN_DRAIN, {"worker": "d1"}, 2.0)
        assert drained == {"ok": True, "worker": "d1", "action": "drain", "state": "draining"}
        assert d1.controls == ["drain"]
        reply = await place(nc, place_request("r1"))
        assert not reply.ok and "draining" in reply.error and d1.reserves == []
        resumed = await request_json(nc, subjects.ADMIN_RESUME, {"worker": "d1"}, 2.0)
        assert resumed["ok"] and d1.controls == ["drain", "resume"]
        await wait_for(lambda: d1.state == "ready")
        assert (await place(nc, place_request("r2"))).ok


async def test_admin_errors_are_json_with_a_message(nats_server: str) -> None:
    async with registry_service(config(nats_server)), connect_nats(nats_server, "c") as nc:
        missing = await request_json(nc, subjects.ADMIN_DRAIN, {}, 2.0)
        assert "worker" in missing["error"]
        unknown = await request_json(nc, subjects.ADMIN_DRAIN, {"worker": "ghost"}, 2.0)
        assert "ghost" in unknown["error"] and "kvmesh admin workers" in unknown["error"]
        bad_level = await request_json(nc, subjects.ADMIN_LOG_LEVEL, {"level": "loud"}, 2.0)
        assert "loud" in bad_level["error"]
        msg = await nc.request(subjects.ADMIN_STATUS, b"not json", timeout=2.0)
        assert "not JSON" in orjson.loads(msg.data)["error"]
        empty = await nc.request(subjects.ADMIN_STATUS, b"", timeout=2.0)  # `nats req ... ''`
        assert "decode" in orjson.loads(empty.data)


async def test_admin_log_level_is_broadcast_and_applied(nats_server: str) -> None:
    logs.setup_logging("info")
    received: list[str] = []

    async def on_level(msg: Msg) -> None:
        received.append(decode_message(msg.data, LogLevel).level)

    async with registry_service(config(nats_server)), connect_nats(nats_server, "c") as nc:
        sub = await nc.subscribe(subjects.CONTROL_LOG_LEVEL, cb=on_level)
        await flush_to_server(nc)
        reply = await request_json(nc, subjects.ADMIN_LOG_LEVEL, {"level": "DEBUG"}, 2.0)
        assert reply == {"ok": True, "level": "debug"}
        await wait_for(lambda: received == ["debug"])
        await wait_for(lambda: logs.current_level() == "debug")  # the registry's own process
        await sub.unsubscribe()
    logs.set_level("info")


async def test_registry_is_discoverable_as_a_nats_micro_service(nats_server: str) -> None:
    async with (
        registry_service(config(nats_server, worker_id="reg-7")),
        connect_nats(nats_server, "c") as nc,
    ):
        ping = orjson.loads((await nc.request("$SRV.PING.kvmesh-kv-registry", b"", timeout=2)).data)
        assert ping["metadata"] == {
            "worker_id": "reg-7",
            "role": "kv-registry",
            "mesh": "kvmesh-tiny",
        }
        info = orjson.loads((await nc.request("$SRV.INFO.kvmesh-kv-registry", b"", timeout=2)).data)
        assert subjects.REGISTRY_PLACE in {e["subject"] for e in info["endpoints"]}
        stats = orjson.loads((await nc.request("$SRV.STATS", b"", timeout=2)).data)
        assert stats["name"] == "kvmesh-kv-registry"


async def test_lease_expiry_is_tracked_and_the_worker_frees_its_blocks(nats_server: str) -> None:
    async with (
        registry_service(config(nats_server)),
        peer_decode(nats_server, "d1") as d1,
        connect_nats(nats_server, "c") as nc,
    ):
        await wait_for(lambda: num_decode(nc))
        assert (await place(nc, place_request("r1", lease_ms=200))).ok
        assert len(d1.free) == 29

        async def expired() -> bool:
            leases = (await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0))["leases"]
            return leases["expired"] == 1 and leases["active"] == 0

        await wait_for(expired)
        await wait_for(lambda: len(d1.free) == 32)


# --- the registry as a process: kill it mid-load, start another, it rebuilds from adverts ---


def start_registry(url: str, worker_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "kvmesh.cli", "serve", "kv-registry", "--nats-url", url),
            *("--worker-id", worker_id, "--heartbeat-s", "0.2", "--log-level", "warning"),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.timeout(120)
async def test_registry_restart_rebuilds_from_adverts_and_serves_again(nats_server: str) -> None:
    first = start_registry(nats_server, "reg-a")
    with reaped(first):
        async with (
            peer_decode(nats_server, "d1", total_blocks=10_000, interval_s=0.2) as d1,
            connect_nats(nats_server, "client") as nc,
        ):
            await wait_for(lambda: _count(nc, 1), timeout_s=60)
            outcomes: list[str] = []
            stop = asyncio.Event()

            async def load() -> None:
                i = 0
                while not stop.is_set():
                    i += 1
                    try:
                        reply = await place(nc, place_request(f"load-{i}", 16), timeout_s=1.0)
                        outcomes.append("ok" if reply.ok else f"refused: {reply.error}")
                    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
                        outcomes.append(type(exc).__name__)  # no registry: the caller sees it
                        await asyncio.sleep(0.05)

            loader = asyncio.create_task(load())
            await wait_for(lambda: outcomes.count("ok") >= 5, timeout_s=30)
            first.send_signal(signal.SIGKILL)  # no goodbye, no state handed over
            await asyncio.to_thread(first.wait, 10)
            # one request may have been answered just before the kill: skip it
            num_before = len(outcomes) + 1
            await wait_for(lambda: len(outcomes) > num_before + 2, timeout_s=30)
            assert set(outcomes[num_before:]) <= {"NoRespondersError", "TimeoutError"}

            second = start_registry(nats_server, "reg-b")
            try:
                # the fresh registry knows d1 again from its periodic adverts
                await wait_for(lambda: _count(nc, 1), timeout_s=60)
                num_restart = len(outcomes)
                try:
                    await wait_for(lambda: outcomes[num_restart:].count("ok") >= 5, timeout_s=30)
                except AssertionError:
                    raise AssertionError(str(outcomes[num_restart:][-5:])) from None
                stop.set()
                await loader
                status = await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0)
                assert status["registry"]["worker_id"] == "reg-b"
                assert status["decode"][0]["worker_id"] == "d1"
                assert len(d1.reserves) >= outcomes.count("ok")  # every ok was a reservation
                assert all(o == "ok" for o in outcomes[num_restart:][-3:])
            finally:
                second.send_signal(signal.SIGTERM)
                assert second.wait(20) == 0  # graceful stop on SIGTERM


async def _count(nc: Client, n: int) -> bool:
    try:
        return await num_decode(nc) == n
    except NatsUnavailableError:  # no registry (yet)
        return False


# --- the same at the full-mesh level: router, prefill, decode as processes ---------------------


def serve(tmp_path: Path, service: str, *flags: str) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"{service}-{len(list(tmp_path.iterdir()))}.log", "wb")  # noqa: SIM115
    with log:
        return subprocess.Popen(
            [sys.executable, "-m", "kvmesh.cli", "serve", service, *flags],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def http_chat(port: int, content: str, max_tokens: int) -> tuple[int, str]:
    body = {"model": "kvmesh-tiny", "messages": [{"role": "user", "content": content}]}
    body["max_tokens"] = max_tokens
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_full_mesh_survives_a_registry_restart(nats_server: str, tmp_path: Path) -> None:
    port = free_port()
    common = ("--nats-url", nats_server, "--log-level", "warning")
    engine = ("--kv-cache-bytes", str(8 << 20), "--heartbeat-s", "0.3")
    procs = {
        "prefill-queue": serve(tmp_path, "prefill-queue", *common),  # no role may make it
        "registry": start_registry(nats_server, "reg-a"),
        "decode": serve(tmp_path, "decode", "--worker-id", "decode-0", *common, *engine),
        "prefill": serve(tmp_path, "prefill", "--worker-id", "prefill-0", *common, *engine),
        "router": serve(tmp_path, "router", *common, "--port", str(port)),
    }
    try:
        async with connect_nats(nats_server, "test") as nc:

            async def mesh_ready() -> bool:
                for name, proc in procs.items():
                    assert proc.poll() is None, f"{name} exited: see {tmp_path}"
                try:
                    status = await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0)
                except NatsUnavailableError:
                    return False
                roles = {w["role"] for w in status["workers"]}
                return {"decode", "prefill", "router"} <= roles

            await wait_for(mesh_ready, timeout_s=400, interval_s=0.5)
            await wait_for(lambda: asyncio.to_thread(_router_ok, port), timeout_s=60)

            # (started_at, finished_at, status, body) of each request; four clients in a loop
            results: list[tuple[float, float, int, str]] = []
            stop = asyncio.Event()

            async def client(i: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    started = time.monotonic()
                    prompt = f"client {i} request {n}: " + "tell me about the mesh " * 6
                    status, body = await asyncio.to_thread(http_chat, port, prompt, 24)
                    results.append((started, time.monotonic(), status, body))
                    if status != 200:
                        await asyncio.sleep(0.1)

            clients = [asyncio.create_task(client(i)) for i in range(4)]
            try:
                await wait_for(lambda: sum(r[2] == 200 for r in results) >= 4, timeout_s=120)
            except AssertionError:
                seen = Counter((r[2], r[3][:120]) for r in results)
                raise AssertionError(f"the mesh did not serve before the kill: {seen}") from None
            procs["registry"].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.to_thread(procs["registry"].wait, 10)
            # one request certain to arrive while no registry runs (the looping clients may all
            # be mid-request through the whole outage on a loaded box)
            outage_started = time.monotonic()
            outage = asyncio.create_task(
                asyncio.to_thread(http_chat, port, "a request during the outage", 8)
            )
            await asyncio.sleep(1.5)  # requests arriving now find no registry
            procs["registry"] = start_registry(nats_server, "reg-b")
            restarted_at = time.monotonic()
            await wait_for(
                lambda: any(r[0] > restarted_at and r[2] == 200 for r in results), timeout_s=120
            )
            stop.set()
            await asyncio.gather(*clients)
            outage_status, outage_body = await outage
            results.append((outage_started, time.monotonic(), outage_status, outage_body))

        # requests already placed finish; one caught in placement fails with a clear timeout;
        # requests during the outage wait for the registry the router heard a moment ago and are
        # served once it is back: nothing else goes wrong
        clear = {
            504: "did not place the request",  # caught in placement by the kill
            503: "no kv-registry answers",  # during the outage
            429: "no live decode workers registered yet",  # the new registry's first moments
        }
        for _, _, status, body in results:
            assert status == 200 or clear.get(status, "<none>") in body, (status, body)
        assert (outage_status, killed_at < outage_started < restarted_at) == (200, True), (
            outage_status,
            outage_body,
        )
        assert any(r[2] == 200 and r[1] < killed_at for r in results)
        assert max(results)[2] == 200  # the last request started is served again
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _router_ok(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


async def test_admin_replies_decode_as_their_protocol_types(nats_server: str) -> None:
    """Every admin reply is exactly one of shared/bus/messages/admin.py's messages: decoded
    strictly (no field missing, none unknown), for each subject and for a refusal."""
    async with (
        registry_service(config(nats_server, worker_id="reg-1")),
        peer_decode(nats_server, "d1"),
        connect_nats(nats_server, "c") as nc,
    ):
        await wait_for(lambda: num_decode(nc))
        for subject, body, cls in (
            (subjects.ADMIN_STATUS, {}, AdminStatus),
            (subjects.ADMIN_WORKERS, {}, AdminWorkers),
            (subjects.ADMIN_DRAIN, {"worker": "d1"}, AdminControlled),
            (subjects.ADMIN_RESUME, {"worker": "d1"}, AdminControlled),
            (subjects.ADMIN_LOG_LEVEL, {"level": "info"}, AdminLogLevelSet),
            (subjects.ADMIN_DRAIN, {"worker": "ghost"}, AdminFailure),
            (subjects.ADMIN_LOG_LEVEL, {"level": "info", "extra": 1}, AdminFailure),
        ):
            msg = await nc.request(subject, orjson.dumps(body), timeout=2.0)
            reply = decode_message(msg.data, cls)
            assert isinstance(reply, cls), (subject, body)
        async with admin_client(nats_server) as admin:
            status = await admin.status()
            assert [r.worker_id for r in status.decode] == ["d1"]
            assert status.registry.worker_id == "reg-1" and status.leases.active == 0
            assert (await admin.drain("d1")).state == "draining"


async def test_admin_client_refuses_a_reply_of_another_shape(nats_server: str) -> None:
    """A registry of another kvmesh version answering in another shape: one clear line."""
    async with connect_nats(nats_server, "old-registry") as nc:

        async def answer(msg: Msg) -> None:
            await msg.respond(orjson.dumps({"decode": "one worker"}))

        await nc.subscribe(subjects.ADMIN_STATUS, cb=answer)
        await flush_to_server(nc)
        async with admin_client(nats_server) as admin:
            with pytest.raises(AdminError, match="another kvmesh version"):
                await admin.status()


async def test_admin_status_says_degraded_while_a_kv_store_is_silent(nats_server: str) -> None:
    beat = lambda: WorkerHeartbeat(
        worker_id="kv-store-0", role="kv-store", load=WorkerLoad("ready")
    )
    liveness = config(nats_server, missed_heartbeats=3)
    async with registry_service(liveness), connect_nats(nats_server, "c") as nc:

        async def degraded() -> list[str]:
            return (await request_json(nc, subjects.ADMIN_STATUS, {}, 2.0))["degraded"]

        store = asyncio.create_task(
            heartbeat_loop(nc, subjects, "kv-store", "kv-store-0", beat, 0.1)
        )

        async def store_seen() -> bool:
            rows = (await request_json(nc, subjects.ADMIN_WORKERS, {}, 2.0))["workers"]
            return "kv-store-0" in {r["worker_id"] for r in rows}

        await wait_for(store_seen)
        assert await degraded() == []
        store.cancel()  # it died and stays down
        await wait_for(lambda: _nonempty(degraded), timeout_s=5.0)
        assert await degraded() == ["kv-store (kv-store-0 silent)"]
        store = asyncio.create_task(
            heartbeat_loop(nc, subjects, "kv-store", "kv-store-0", beat, 0.1)
        )
        try:  # back under its id: no longer degraded
            await wait_for(lambda: _empty(degraded), timeout_s=5.0)
        finally:
            store.cancel()


async def _nonempty(get) -> bool:
    return bool(await get())


async def _empty(get) -> bool:
    return not await get()
