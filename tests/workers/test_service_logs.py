"""What every service logs at info (issue 45): a start-up line that fits a terminal (the whole
config at debug, where it was a line of up to 958 characters at info), and one line for a
mesh-wide log-level change, naming who made it (it was logged by every service, 4 times under
``kvmesh up``, naming none)."""

from __future__ import annotations

import logging

from kvmesh.services.kv_registry.service import registry_service
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.worker_presence import log_level_control
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.obs import logs
from support.log_capture import captured
from support.registry_peers import wait_for
from test_registry_service import config, request_json

from kvmesh.cli import main


def _serve_once(monkeypatch, capsys, *flags: str) -> list[str]:
    """``kvmesh serve kv-registry`` with its run returning at once: the lines it logged."""
    import kvmesh.services.kv_registry as registry

    async def run(_config) -> None:
        return None

    monkeypatch.setattr(registry, "run", run)
    before = logging.getLogger().level
    try:
        assert (
            main(["serve", "kv-registry", "--nats-url", "nats://u:s3cret@127.0.0.1:1", *flags]) == 0
        )
    finally:
        logging.getLogger().setLevel(before)
    return capsys.readouterr().err.splitlines()


def test_the_config_is_logged_at_debug_and_start_up_lines_stay_short(monkeypatch, capsys):
    at_info = _serve_once(monkeypatch, capsys)
    assert any("starting" in line and "kv-registry" in line for line in at_info), at_info
    assert all(len(line) < 200 for line in at_info), max(at_info, key=len)
    assert not any("RegistryConfig(" in line for line in at_info)
    at_debug = _serve_once(monkeypatch, capsys, "--log-level", "debug")
    (shown,) = [line for line in at_debug if "RegistryConfig(" in line]
    assert "heartbeat_s=" in shown and "s3cret" not in shown  # every field, no secret


async def test_a_log_level_change_is_logged_once_naming_the_registry(nats_server):
    subjects = Subjects(DEFAULT_MESH)
    names = ("kvmesh.services.kv_registry.admin", "kvmesh.shared.bus.worker_presence")
    with captured(*names) as log:
        async with (
            registry_service(config(nats_server, worker_id="reg-1")),
            connect_nats(nats_server, "decode-7") as nc,
            log_level_control(nc, subjects, "decode-7"),
        ):
            await flush_to_server(nc)
            for level in ("debug", "debug", "info"):
                reply = await request_json(nc, subjects.ADMIN_LOG_LEVEL, {"level": level}, 2.0)
                assert reply == {"ok": True, "level": level}
                await wait_for(lambda level=level: logs.current_level() == level)
    changes = [e for e in log.events if e["event"].startswith("log level")]
    warned = [e for e in changes if e["level"] == "warning"]
    assert [(e["service"], e["event"]) for e in warned] == [
        ("reg-1", f"log level set to {level} on every service (kvmesh admin log-level)")
        for level in ("debug", "debug", "info")
    ]  # one line per change for the whole mesh, by the registry that made it
    noted = [e for e in changes if e["level"] == "debug"]
    assert noted and {e["service"] for e in noted} <= {"reg-1", "decode-7"}
    assert all(e["event"] == "log level changed from info to debug" for e in noted)
