"""`kvmesh up` restarts a service that dies once the mesh is up: backoff within a budget (pure),
and a real mesh whose killed decode worker, then its killed nats-server, come back and serve
again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
from support.proc_tree import cmdline, descendants
from test_up import admin_status_json, chat, launch, wait_for_line

from kvmesh.commands.restarts import RestartPolicy


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
                (d["worker_id"], d["free_blocks"] == d["total_blocks"])
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
