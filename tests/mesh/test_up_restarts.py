"""`kvmesh up` restarts a service that dies once the mesh is up: backoff within a budget (pure),
and a real mesh whose killed decode worker, then its killed nats-server, come back and serve
again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest
from support.proc_tree import cmdline, descendants
from test_up import admin_status_json, chat, launch, wait_for_line

from kvmesh.commands.launch_error import LaunchError
from kvmesh.commands.launcher import Launcher
from kvmesh.commands.restarts import LeaveDown, Restart, RestartPolicy, StopMesh
from kvmesh.commands.up_config import UpConfig
from kvmesh.commands.up_plan import ChildSpec


def test_restart_delays_double_up_to_the_cap_and_the_budget_ends_them():
    policy = RestartPolicy(max_restarts=5, window_s=300, first_delay_s=1, max_delay_s=4)
    assert [policy.on_exit("d", t) for t in (0, 1, 2, 3, 4)] == [1, 2, 4, 4, 4]
    assert policy.on_exit("d", 5) is None  # a sixth death within the window: give up
    assert policy.on_exit("p", 5) == 1  # every child has its own budget


def test_restart_budget_forgets_deaths_older_than_the_window():
    policy = RestartPolicy(max_restarts=2, window_s=10)
    assert policy.on_exit("d", 0) == 1 and policy.on_exit("d", 5) == 2
    assert policy.on_exit("d", 20) == 1  # the first two are out of the window
    assert policy.restarts("d") == 1


def _child(name: str, tier: str, *python: str) -> tuple[ChildSpec, subprocess.Popen[bytes]]:
    """A child that runs ``python -c ...`` first; restarted, it runs ``kvmesh <argv>``, which
    fails at once (no such command)."""
    spec = ChildSpec(name, tier, ("no-such-command",))
    return spec, subprocess.Popen([sys.executable, "-c", *python], stderr=subprocess.DEVNULL)


async def test_supervisor_leaves_a_failing_kv_store_down_and_keeps_the_mesh_up(capsys):
    launcher = Launcher(UpConfig(port=1), log=subprocess.DEVNULL)
    decode = _child("decode-0", "decode", "import time; time.sleep(60)")
    store = _child("kv-store-0", "kv-store", "raise SystemExit(3)")
    launcher.children = {spec.name: (spec, proc) for spec, proc in (decode, store)}
    policy = RestartPolicy(max_restarts=1, first_delay_s=0.0)
    supervising = asyncio.create_task(launcher.supervise(policy, poll_s=0.05))
    try:
        for _ in range(300):  # the store dies, is restarted once, dies again: left down
            if launcher.left_down:
                break
            await asyncio.sleep(0.05)
        assert launcher.left_down == {"kv-store-0"}
        await asyncio.sleep(0.5)
        assert not supervising.done()  # the mesh goes on
        assert "kvmesh up: kv-store-0 exited with code 2, 2 times" in capsys.readouterr().err
    finally:
        supervising.cancel()
        decode[1].kill()
        decode[1].wait()


async def test_supervisor_stops_the_mesh_when_a_decode_worker_cannot_stay_up():
    launcher = Launcher(UpConfig(port=1), log=subprocess.DEVNULL)
    spec, proc = _child("decode-0", "decode", "raise SystemExit(3)")
    launcher.children = {spec.name: (spec, proc)}
    policy = RestartPolicy(max_restarts=1, first_delay_s=0.0)
    with pytest.raises(LaunchError, match="decode-0 exited with code 2, 2 times"):
        await asyncio.wait_for(launcher.supervise(policy, poll_s=0.05), 30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_restarts_a_killed_decode_worker_and_its_nats_server_and_serves_again(
    tmp_path: Path,
) -> None:
    proc, out, err, port, nats_url = launch(tmp_path, "--local-prefill-threshold", "16")
    try:
        wait_for_line(proc, out, "kvmesh is up", timeout_s=400)
        [victim] = [p for p in descendants(proc.pid) if "serve decode" in cmdline(p)]
        os.kill(victim, signal.SIGKILL)
        wait_for_line(proc, err, "restarted decode-0", timeout_s=60)
        assert "decode-0 exited with code -9; restarting it in 1 s" in err.read_text()
        deadline = time.monotonic() + 120
        while True:  # 503 while no decode worker is alive; the new decode-0 loads and serves
            try:
                reply = chat(port, "tell me about supervision " * 8, max_tokens=3)
                break
            except urllib.error.HTTPError as exc:
                assert exc.code == 503 and time.monotonic() < deadline, exc
                time.sleep(1)
        assert 1 <= reply["usage"]["completion_tokens"] <= 3
        for _ in range(30):  # the new decode-0's advert, with every block back
            rows = [
                (d["worker_id"], d["pool"]["free_blocks"] == d["pool"]["total_blocks"])
                for d in admin_status_json(nats_url, err)["decode"]
            ]
            if rows == [("decode-0", True)]:
                break
            time.sleep(0.5)
        assert rows == [("decode-0", True)]

        # kill -9 of the nats-server it started: reaped, logged, restarted on the same port
        [nats] = [p for p in descendants(proc.pid) if "nats-server" in cmdline(p)]
        os.kill(nats, signal.SIGKILL)
        wait_for_line(proc, err, "restarted nats-server at", timeout_s=60)
        assert "nats-server exited with code -9; restarting it in 1 s" in err.read_text()
        assert nats not in descendants(proc.pid)  # no zombie left behind
        deadline = time.monotonic() + 60
        while True:  # the services reconnect; the router serves again
            try:
                reply = chat(port, "tell me about supervision " * 8, max_tokens=3)
                break
            except (urllib.error.HTTPError, urllib.error.URLError) as exc:
                assert time.monotonic() < deadline, exc
                time.sleep(0.5)
        assert 1 <= reply["usage"]["completion_tokens"] <= 3
        # the same users and password file: kvmesh admin still gets in
        assert [d["worker_id"] for d in admin_status_json(nats_url, err)["decode"]] == ["decode-0"]
        assert proc.poll() is None  # the launcher never stopped
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_an_optional_service_out_of_restarts_is_left_down_and_a_needed_one_stops_the_mesh():
    policy = RestartPolicy(max_restarts=2, window_s=300)
    assert policy.after_death("kv-store-0", "kv-store", 0) == Restart(1)
    assert policy.after_death("kv-store-0", "kv-store", 1) == Restart(2)
    assert policy.after_death("kv-store-0", "kv-store", 3) == LeaveDown(3)
    for t in (0, 1):
        assert isinstance(policy.after_death("draft-0", "draft", t), Restart)
    assert policy.after_death("draft-0", "draft", 2) == LeaveDown(3)
    for t in (0, 1):
        assert isinstance(policy.after_death("decode-0", "decode", t), Restart)
    assert policy.after_death("decode-0", "decode", 2) == StopMesh(3)


def test_an_optional_service_is_left_down_at_its_first_death_without_restarts():
    policy = RestartPolicy(max_restarts=0)
    assert policy.after_death("kv-store-0", "kv-store", 0) == LeaveDown(1)
    assert policy.after_death("router-0", "router", 0) == StopMesh(1)
