"""``kvmesh up``'s launcher: starts the services of a plan in order (on the NATS mesh_nats.py
finds or starts), watches and restarts them, and stops them tier by tier."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO

from kvmesh.commands.cpu_plan import CpuPlan
from kvmesh.commands.launch_error import LaunchError
from kvmesh.commands.mesh_nats import default_nats_url, join_nats, make_queue, start_nats
from kvmesh.commands.nats_supervisor import NatsSupervisor
from kvmesh.commands.restarts import LeaveDown, RestartPolicy, StopMesh
from kvmesh.commands.up_config import TIERS, UpConfig
from kvmesh.commands.up_plan import ChildSpec, cpu_plan, plan, with_metrics_ports
from kvmesh.shared.bus.mesh_state import MeshState, remove_state, write_state
from kvmesh.shared.bus.nats_auth import MeshCredentials, NatsAuth, auth_from_env
from kvmesh.shared.config.nats_options import strip_credentials, url_has_credentials
from kvmesh.shared.config.ports import held_port
from kvmesh.shared.config.service_config import DEFAULT_NATS_URL


class Launcher:
    def __init__(self, config: UpConfig, log: BinaryIO | None = None) -> None:
        self.config = config
        self.log = log  # where the services' output goes (None: this process's stderr)
        self.nats_url = config.nats_url  # where the mesh's NATS is (set by start)
        self.port = config.port  # the router's; a free one held for it by start when 0
        self._held: list[socket.socket] = []  # ports kept for children until stop (held_port)
        self.children: dict[str, tuple[ChildSpec, subprocess.Popen[bytes]]] = {}
        self.nats = None  # NatsServer we started, if any
        # One NATS user per role on a server we start (shared/bus/nats_auth.py); on a server we
        # found, whatever credentials the environment holds.
        self.credentials: MeshCredentials | None = None
        self.nats_auth: NatsAuth | None = auth_from_env()  # this process's own client (admin)
        self.admin_password_file: Path | None = None
        self._envs: dict[str, dict[str, str]] = {}  # child name -> environment it started with
        self.state: MeshState | None = (
            None  # what this launcher recorded (shared/bus/mesh_state.py)
        )
        self.metrics_urls: dict[str, str] = {}  # service name -> its /metrics (set by start)
        self.cpus: CpuPlan | None = None  # how the workers share the cores (set by start)
        self.left_down: set[str] = set()  # optional services that could not stay up

    @property
    def mesh(self) -> str:
        assert self.config.mesh is not None
        return self.config.mesh

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        from kvmesh.shared.bus.nats_server import nats_is_reachable

        url = self.config.nats_url
        if url == DEFAULT_NATS_URL:
            url = default_nats_url(self.mesh)
        if not nats_is_reachable(url):
            self._start_nats(url)
        else:  # joined only with credentials, only where who runs it is known, not twice
            join_nats(url, self.config, self.nats_auth)
            self.nats_url = url
        if self.config.mode == "disagg":  # as admin, before any role connects: docs/security.md
            make_queue(self.nats_url, self.mesh, self.nats_auth, self.config.nats_security)
        self.cpus = self._plan_cpus()
        if not self.config.port:
            self.port = self._hold(self.config.host or "127.0.0.1")
        specs = plan(self.config, self.nats_url, self.port, self.cpus)
        ports = {s.name: self._hold("127.0.0.1") for s in specs if s.tier != "router"}
        self.metrics_urls = {
            s.name: f"{self.url}/metrics"
            if s.tier == "router"
            else f"http://127.0.0.1:{ports[s.name]}/metrics"
            for s in specs
        }
        self.state = MeshState(
            mesh=self.mesh,
            nats_url=strip_credentials(self.nats_url),
            pid=os.getpid(),
            router_url=self.url,
            admin_password_file=str(self.admin_password_file or ""),
            metrics_urls=self.metrics_urls,
        )
        write_state(self.state)
        for spec in with_metrics_ports(specs, ports):
            self._spawn(spec)

    def _hold(self, host: str) -> int:
        """A port on ``host`` held for a child until stop, across its restarts: no other
        process's pick (free_port) takes it before the child binds it (ports.held_port)."""
        sock = held_port(host)
        self._held.append(sock)
        return sock.getsockname()[1]

    def _plan_cpus(self) -> CpuPlan:
        """The cores' plan, off the cores other meshes' workers are pinned to where this machine
        has enough others (pinned_cores.py); a line on stderr says where it pinned, or that it
        shares pinned cores with another mesh."""
        from kvmesh.commands.pinned_cores import pinned_workers, pinning_note, taken_cores

        others = pinned_workers()
        cpus = cpu_plan(self.config, taken_cores(others))
        pinned = frozenset(cpu for role in cpus.roles.values() for cpu in role.cpus)
        note = pinning_note(pinned, others) if pinned else ""
        if note:
            print(f"kvmesh up: {note}", file=sys.stderr, flush=True)
        return cpus

    def _start_nats(self, url: str) -> None:
        """A nats-server of the mesh's own at ``url``; this process its admin."""
        started = start_nats(url, self.mesh, self.config.subjects)
        self.nats, self.credentials = started.server, started.credentials
        self.nats_url, self.nats_auth = started.server.url, started.admin
        self.admin_password_file = started.admin_password_file

    def _spawn(self, spec: ChildSpec) -> None:
        """Start ``spec``'s process; a restart gets the environment of the first start."""
        from kvmesh.shared.bus.nats_server import die_with_parent

        argv = [sys.executable, "-m", "kvmesh.cli", *spec.argv]
        env = self._envs.get(spec.name)
        if env is None:
            env = dict(os.environ)  # ours (an external server's credentials, if any)
            if self.credentials is not None:
                env.update(self.credentials.auth(spec.argv[1]).env())
            if url_has_credentials(self.nats_url):  # not in argv: ps would show them
                env["KVMESH_NATS_URL"] = self.nats_url
            for key, value in spec.env:
                env.setdefault(key, value)
            self._envs[spec.name] = env
        proc = subprocess.Popen(
            argv,
            start_new_session=True,
            preexec_fn=die_with_parent,
            env=env,
            stdout=self.log,
            stderr=self.log,
        )
        self.children[spec.name] = (spec, proc)

    def dead(self) -> list[tuple[ChildSpec, int]]:
        """Children that exited, with their exit codes."""
        return [
            (spec, proc.returncode)
            for spec, proc in self.children.values()
            if proc.poll() is not None
        ]

    def check_alive(self) -> None:
        if self.nats is not None and (code := self.nats.exit_code()) is not None:
            raise LaunchError(f"the nats-server at {self.nats.url} exited with code {code}")
        for spec, code in self.dead():
            raise LaunchError(
                f"{spec.name} exited with code {code}; its log is above "
                f"(rerun it alone: kvmesh {' '.join(spec.argv)})"
            )

    async def supervise(self, policy: RestartPolicy, poll_s: float = 0.5) -> None:
        """Restart children that die, with backoff, until a needed one dies too often
        (LaunchError); an optional one (a kv-store, a draft worker) that does is left down and
        the mesh goes on without it (``left_down``)."""
        pending: dict[str, float] = {}  # name -> monotonic time to restart it at
        nats = NatsSupervisor(self.nats, policy) if self.nats is not None else None
        while True:
            now = time.monotonic()
            if nats is not None:
                nats.check(now)  # the nats-server we started, restarted like a service
            for spec, code in self.dead():
                if spec.name in pending or spec.name in self.left_down:
                    continue
                verdict = policy.after_death(spec.name, spec.tier, now)
                deaths = f"{policy.restarts(spec.name)} times within {policy.window_s:g} s"
                if isinstance(verdict, StopMesh):
                    raise LaunchError(
                        f"{spec.name} exited with code {code}, {deaths}; stopping the mesh (its "
                        f"log is above; rerun it alone: kvmesh {' '.join(spec.argv)})"
                    )
                if isinstance(verdict, LeaveDown):
                    self.left_down.add(spec.name)
                    print(
                        f"kvmesh up: {spec.name} exited with code {code}, {deaths}; leaving it "
                        f"down: the mesh serves without it, degraded (its log is above; rerun "
                        f"it alone: kvmesh {' '.join(spec.argv)})",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                print(
                    f"kvmesh up: {spec.name} exited with code {code}; restarting it in "
                    f"{verdict.delay_s:g} s (death {policy.restarts(spec.name)} of at most "
                    f"{policy.max_restarts} in {policy.window_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
                pending[spec.name] = now + verdict.delay_s
            for name, at in list(pending.items()):
                if now >= at:
                    del pending[name]
                    self._spawn(self.children[name][0])
                    print(f"kvmesh up: restarted {name}", file=sys.stderr, flush=True)
            await asyncio.sleep(poll_s)

    async def wait_ready(self) -> None:
        """Router /health OK, the registry sees every decode (and prefill) worker, and every
        service's /metrics port takes connections."""
        from kvmesh.shared.bus.admin_client import AdminError, admin_client

        deadline = time.monotonic() + self.config.startup_timeout_s
        num_prefill = self.config.prefill if self.config.mode == "disagg" else 0
        num_draft = self.config.draft_workers if self.config.draft else 0
        routers = self.config.routers
        waiting_for = "NATS"
        async with admin_client(
            self.nats_url,
            timeout_s=2.0,
            auth=self.nats_auth,
            mesh=self.mesh,
            security=self.config.nats_security,
        ) as admin:
            while time.monotonic() < deadline:
                self.check_alive()
                try:
                    status = await admin.status()
                except AdminError:
                    waiting_for = "the kv-registry"
                else:
                    num_decode = len(status.decode)
                    prefills = [w for w in status.workers if w.role == "prefill"]
                    if num_decode < self.config.decode:
                        waiting_for = f"decode workers ({num_decode}/{self.config.decode})"
                    elif len(prefills) < num_prefill:
                        waiting_for = f"prefill workers ({len(prefills)}/{num_prefill})"
                    elif (n := sum(1 for w in status.workers if w.role == "draft")) < num_draft:
                        waiting_for = f"draft workers ({n}/{num_draft})"
                    elif (n := len(status.stores)) < self.config.kv_store:
                        waiting_for = f"kv-stores ({n}/{self.config.kv_store})"
                    elif (n := sum(w.role == "router" for w in status.workers)) < routers:
                        waiting_for = f"routers ({n}/{routers})"  # one port: health reaches one
                    elif status.prefill_queue.note and num_prefill:
                        waiting_for = "the prefill queue (prefill-queue-0)"
                    elif not await asyncio.to_thread(self._router_healthy):
                        waiting_for = "the router"
                    elif closed := await asyncio.to_thread(self._metrics_not_listening):
                        # a worker heartbeats a step before its /metrics listens: a scrape
                        # right after "ready" was refused
                        waiting_for = f"the /metrics of {', '.join(closed)}"
                    else:
                        return
                await asyncio.sleep(0.25)
        raise LaunchError(
            f"the mesh was not ready within {self.config.startup_timeout_s:g}s: waiting for "
            f"{waiting_for} (raise --startup-timeout-s for big models)"
        )

    def nats_violations(self) -> list[str]:
        """What the nats-server we started refused a role (empty: every role kept to its
        permissions, or the server is not ours)."""
        return self.nats.permission_violations() if self.nats is not None else []

    def _metrics_not_listening(self) -> list[str]:
        """The services (not left down) whose metrics port refuses a connection."""
        closed = []
        for name, url in self.metrics_urls.items():
            parts = urllib.parse.urlsplit(url)
            if name in self.left_down or parts.port is None:
                continue
            try:
                socket.create_connection((parts.hostname, parts.port), timeout=1.0).close()
            except OSError:
                closed.append(name)
        return closed

    def _router_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2.0) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """Stop tier by tier: SIGTERM each process group, SIGKILL what outlives the timeout."""
        for tier in TIERS:
            procs = [p for spec, p in self.children.values() if spec.tier == tier]
            for proc in procs:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_timeout_s
            for proc in procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    proc.wait()
                _signal_group(proc, signal.SIGKILL)  # leftovers of the group (helpers)
        self.children.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        if self.state is not None:
            remove_state(self.state)
            self.state = None
        for sock in self._held:
            sock.close()
        self._held.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid
