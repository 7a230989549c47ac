"""``kvmesh up``'s launcher: starts the services of a plan in order (NATS first when none
answers), watches and restarts them, and stops them tier by tier."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import BinaryIO

from kvmesh.commands.cpu_plan import CpuPlan
from kvmesh.commands.nats_supervisor import NatsSupervisor
from kvmesh.commands.restarts import LeaveDown, RestartPolicy, StopMesh
from kvmesh.commands.up_config import TIERS, UpConfig
from kvmesh.commands.up_plan import ChildSpec, cpu_plan, plan, with_metrics_ports
from kvmesh.shared.bus.mesh_state import MeshState, remove_state, running_meshes, write_state
from kvmesh.shared.bus.nats_auth import (
    ADMIN,
    PASSWORD_FILE_ENV,
    USER_ENV,
    MeshCredentials,
    NatsAuth,
    auth_from_env,
)
from kvmesh.shared.config.nats_options import (
    NatsSecurity,
    redact_url,
    strip_credentials,
    url_has_credentials,
)
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.config.service_config import DEFAULT_NATS_URL


class LaunchError(RuntimeError):
    """A service exited or did not become ready; the message says which and how to look."""


class Launcher:
    def __init__(self, config: UpConfig, log: BinaryIO | None = None) -> None:
        self.config = config
        self.log = log  # where the services' output goes (None: this process's stderr)
        self.nats_url = config.nats_url  # where the mesh's NATS is (set by start)
        self.port = config.port or free_port()
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
        from kvmesh.shared.bus.nats_vetting import NatsVettingError, vet_nats_url

        url = self.config.nats_url
        if url == DEFAULT_NATS_URL:
            url = self._default_nats_url()
        if not nats_is_reachable(url):
            self._start_nats(url)
        else:
            security = self.config.nats_security
            try:  # joined only with credentials, and only where who runs it is known
                vet_nats_url(
                    url,
                    insecure=self.config.nats_insecure,
                    has_credentials=bool(
                        self.nats_auth or url_has_credentials(url) or security.creds
                    ),
                    tls=security.uses_tls,
                    trust_network=security.trust_network,
                )
            except NatsVettingError as exc:
                raise LaunchError(str(exc)) from None
            self._check_mesh_absent(url)
        if self.config.mode == "disagg":  # as admin, before any role connects: docs/security.md
            self._make_prefill_queue()
        self.cpus = self._plan_cpus()
        specs = plan(self.config, self.nats_url, self.port, self.cpus)
        ports = {s.name: free_port() for s in specs if s.tier != "router"}  # kept across restarts
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

    def _make_prefill_queue(self) -> None:
        from kvmesh.commands.queue_setup import make_prefill_queue
        from kvmesh.shared.bus.nats_connect import NatsUnavailableError
        from kvmesh.shared.bus.prefill_job_stream import PrefillQueueError

        try:
            _run_sync(
                make_prefill_queue(
                    self.nats_url,
                    self.mesh,
                    auth=self.nats_auth,
                    security=self.config.nats_security,
                )
            )
        except (PrefillQueueError, NatsUnavailableError) as exc:
            raise LaunchError(f"{exc} (or make it first: kvmesh admin prefill-queue)") from None

    def _default_nats_url(self) -> str:
        """The NATS URL of a launcher left at the default: the default, unless the server there
        belongs to another ``kvmesh up``'s mesh, then a free port of our own. The same mesh
        already up on this machine is refused."""
        meshes = running_meshes()
        same = [m for m in meshes if m.mesh == self.mesh]
        if same:
            other = same[0]
            raise LaunchError(
                f"mesh {self.mesh!r} is already up on this machine (kvmesh up pid {other.pid}, "
                f"{other.router_url}, NATS {other.nats_url}); give this one another --mesh, or "
                "stop that one first"
            )
        owner = next((m for m in meshes if m.nats_url == DEFAULT_NATS_URL), None)
        if owner is None:
            return DEFAULT_NATS_URL
        url = f"nats://127.0.0.1:{free_port()}"
        print(
            f"kvmesh up: {DEFAULT_NATS_URL} is the nats-server of mesh {owner.mesh!r} (kvmesh up "
            f"pid {owner.pid}); mesh {self.mesh!r} gets its own at {url} (kvmesh admin "
            f"--mesh {self.mesh} finds it)",
            file=sys.stderr,
        )
        return url

    def _start_nats(self, url: str) -> None:
        from kvmesh.shared.bus.nats_server import NatsServer, parse_nats_url

        if not url.startswith("nats://") or url_has_credentials(url):
            raise LaunchError(
                f"nothing answers at {redact_url(url)}, and kvmesh up starts a nats-server only "
                "for a plain nats://HOST:PORT URL (credentials and TLS are the operator's "
                "server's); start that server first, or give a nats:// URL"
            )
        host, nats_port = parse_nats_url(url)
        self.credentials = MeshCredentials.generate()
        self.nats = NatsServer(
            nats_port,
            host=host,
            authorization=self.credentials.server_config(self.config.subjects),
        )
        self.nats.start()
        self.nats_url = self.nats.url
        self.nats_auth = self.credentials.auth(ADMIN)
        self.admin_password_file = self.nats.state_dir / "admin.password"
        fd = os.open(self.admin_password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.nats_auth.password)
        print(
            f"kvmesh up: started nats-server at {self.nats.url} for mesh {self.mesh!r}, one "
            f"user per role; for kvmesh admin: export {USER_ENV}={ADMIN} "
            f"{PASSWORD_FILE_ENV}={self.admin_password_file} (kvmesh admin --mesh {self.mesh} "
            "finds both by itself)",
            file=sys.stderr,
        )

    def _check_mesh_absent(self, url: str) -> None:
        """Join the NATS at ``url`` unless this mesh already runs there: its workers would count
        as ours, and ours would take its requests. Other meshes there are no concern."""
        from kvmesh.shared.bus.nats_connect import NatsUnavailableError

        self.nats_url = url
        try:
            others = _run_sync(
                workers_on(
                    url, auth=self.nats_auth, mesh=self.mesh, security=self.config.nats_security
                )
            )
        except NatsUnavailableError as exc:  # e.g. a server of another mesh, with its own users
            raise LaunchError(
                f"cannot join the NATS server at {redact_url(url)}: {exc}; or give this mesh a "
                "nats-server of its own: --nats-url nats://127.0.0.1:PORT with a free PORT"
            ) from None
        if others:
            raise LaunchError(
                f"mesh {self.mesh!r} is already running on {redact_url(url)} (workers: "
                f"{', '.join(sorted(others)[:6])}{', ...' if len(others) > 6 else ''}); start "
                f"this one as another mesh (--mesh NAME), or on its own NATS (e.g. --nats-url "
                "nats://127.0.0.1:4223; it is started here if nothing answers), or stop the "
                "other one first"
            )

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
        """Router /health OK and the registry sees every decode (and prefill) worker."""
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


async def workers_on(
    nats_url: str,
    listen_s: float = 1.2,
    auth: NatsAuth | None = None,
    *,
    mesh: str,
    security: NatsSecurity | None = None,
) -> set[str]:
    """Worker ids of mesh ``mesh`` heard on ``nats_url``: its registry's list, or heartbeats
    for ``listen_s``."""
    from kvmesh.shared.bus.admin_client import AdminError, admin_client
    from kvmesh.shared.bus.messages.codec import MessageError, decode_message
    from kvmesh.shared.bus.messages.workers import WorkerHeartbeat

    async with admin_client(
        nats_url, timeout_s=2.0, auth=auth, mesh=mesh, security=security
    ) as admin:
        try:
            return {w.worker_id for w in await admin.workers()}
        except AdminError:  # no registry: listen for heartbeats instead
            pass
        heard: set[str] = set()

        async def on_beat(msg) -> None:
            with contextlib.suppress(MessageError):
                heard.add(decode_message(msg.data, WorkerHeartbeat).worker_id)

        sub = await admin.nc.subscribe(admin.subjects.HEARTBEAT_ALL, cb=on_beat)
        await asyncio.sleep(listen_s)
        await sub.unsubscribe()
        return heard


def _run_sync(coro):
    """Run a coroutine to completion from sync code, also when called inside an event loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)  # start_new_session: pgid == pid
