#!/usr/bin/env python3
"""A kvmesh mesh over three "hosts" on one machine: network namespaces on a Linux bridge.

    sudo .venv/bin/python scripts/netns_mesh.py [--delay-ms 1] [--loss-pct 0]

builds namespaces ``<id>-1..3`` (10.77.K.1-3/24, K picked free) on bridge ``kvb<id>``, one
nats-server per namespace joined into a cluster (routes; JetStream R3), then the prefill-queue
keeper, kv-registry and router in host 1, prefill in host 2, two decode workers in host 3, over the tcp transport, each service
listing its own host's NATS server first. The bridge holds 10.77.K.254 so that this process (in
the root namespace) reaches the router and NATS; nothing is routed beyond the bridge. Ctrl-C tears
everything down; so does any failure on the way up. tests/support/netns_harness.py wraps it for pytest.

Needs root or CAP_NET_ADMIN and iproute2. Delay and loss on the links (``--delay-ms``,
``--loss-pct``) come from ``tc netem`` where the kernel has sch_netem (``netem_available()``);
where it has not, each host's link is a pair of TAP devices joined by scripts/tap_link.py, a
user-space link with the same delay and loss (``Network.link_kind`` says which).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.shared.bus.nats_server import ClusterSpec, NatsServer, die_with_parent

NATS_PORT = 4222
ROUTE_PORT = 6222
ROUTER_PORT = 8000
NUM_HOSTS = 3


class NetnsUnavailableError(RuntimeError):
    """This machine cannot build namespaces (no root / CAP_NET_ADMIN, no iproute2)."""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result


def why_unavailable() -> str | None:
    """None when namespaces can be built here; else why not (for a skip message)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"kvprobe{secrets.token_hex(3)}"
    result = _run("ip", "netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace (needs root or CAP_NET_ADMIN): {result.stderr}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether the kernel has sch_netem (delay and loss on a link)."""
    if shutil.which("tc") is None:
        return False
    probe = f"kvprobe{secrets.token_hex(3)}"
    _run("ip", "netns", "add", probe)
    try:
        return (
            _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root",
                 "netem", "delay", "1ms", check=False).returncode == 0
        )  # fmt: skip
    finally:
        _run("ip", "netns", "del", probe, check=False)


def link_emulation_available() -> bool:
    """Whether links can have delay and loss here: sch_netem, or TAP devices for tap_link.py."""
    return netem_available() or os.path.exists("/dev/net/tun")


def _free_subnet() -> int:
    """K such that 10.77.K.0/24 appears on no interface of this machine."""
    used = _run("ip", "-4", "-o", "addr").stdout
    for _ in range(64):
        k = secrets.randbelow(250) + 1
        if f" 10.77.{k}." not in used:
            return k
    raise RuntimeError("no free 10.77.K.0/24 subnet")


@dataclass
class Network:
    """The bridge, the namespaces and their links; ``close()`` removes all of them.

    A link is a veth pair, with netem on both ends when there is delay or loss and the kernel
    has sch_netem (``link_kind`` "netem"), else a TAP pair forwarded by tap_link.py ("tap");
    "plain" without delay or loss."""

    delay_ms: float = 0.0
    loss_pct: float = 0.0
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: int = field(default_factory=_free_subnet)
    created: list[tuple[str, str]] = field(default_factory=list)  # (kind, name), in order
    link_kind: str = "plain"
    links: list[subprocess.Popen[str]] = field(default_factory=list)  # tap_link.py processes

    @property
    def bridge(self) -> str:
        return f"kvb{self.run_id}"

    def ns(self, host: int) -> str:
        return f"kvmesh-{self.run_id}-{host}"

    def veth(self, host: int) -> str:  # host side of host's link (<= 15 characters)
        return f"kvv{self.run_id}{host}"

    def ip(self, host: int) -> str:
        return f"10.77.{self.subnet}.{host}"

    def build(self) -> None:
        if self.delay_ms or self.loss_pct:
            self.link_kind = "netem" if netem_available() else "tap"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self.created.append(("link", self.bridge))
        _run("ip", "addr", "add", f"10.77.{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        self._allow_forwarding()
        for host in range(1, NUM_HOSTS + 1):
            ns, veth = self.ns(host), self.veth(host)
            _run("ip", "netns", "add", ns)
            self.created.append(("netns", ns))
            if self.link_kind == "tap":
                self._start_tap_link(host)
            else:
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)  # fmt: skip
            self.created.append(("link", veth))
            _run("ip", "link", "set", veth, "master", self.bridge, "up")
            self.exec(host, "ip", "addr", "add", f"{self.ip(host)}/24", "dev", "eth0")
            self.exec(host, "ip", "link", "set", "eth0", "up")
            self.exec(host, "ip", "link", "set", "lo", "up")
            if self.link_kind == "netem":
                self.netem(host, self.delay_ms, self.loss_pct)

    def _forward_rule(self) -> tuple[str, ...]:
        return ("FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT")

    def _allow_forwarding(self) -> None:
        """Let the hosts reach each other across the bridge where a firewall would drop it: a
        Docker daemon that has run sets the FORWARD policy to DROP, and with br_netfilter that
        applies to bridged frames too (the hosts' NATS cluster never forms). Where iptables is
        missing or refuses, nothing is needed or can be done."""
        if shutil.which("iptables") is None:
            return
        if _run("iptables", "-I", *self._forward_rule(), check=False).returncode == 0:
            self.created.append(("iptables", self.bridge))

    def _start_tap_link(self, host: int) -> None:
        """host's link as tap_link.py: the TAP ``veth(host)`` here, ``eth0`` in its namespace."""
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("tap_link.py")), "--ns", self.ns(host),
             "--outer", self.veth(host), "--delay-ms", str(self.delay_ms),
             "--loss-pct", str(self.loss_pct), "--seed", str(host)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent,
        )  # fmt: skip
        self.links.append(proc)
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            proc.kill()
            _, err = proc.communicate(timeout=5)
            raise RuntimeError(f"tap_link.py for host {host} did not start: {err.strip()}")

    def exec(self, host: int, *cmd: str) -> None:
        _run("ip", "netns", "exec", self.ns(host), *cmd)

    def netem(self, host: int, delay_ms: float = 0.0, loss_pct: float = 0.0) -> None:
        """Delay and loss on host's link (both directions: its side and the bridge's)."""
        args = ["netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%"]
        self.exec(host, "tc", "qdisc", "replace", "dev", "eth0", "root", *args)
        _run("tc", "qdisc", "replace", "dev", self.veth(host), "root", *args)

    def set_link(self, host: int, up: bool) -> None:
        """Cut (or restore) host's only link: nothing reaches it or leaves it."""
        _run("ip", "link", "set", self.veth(host), "up" if up else "down")

    def close(self) -> None:
        for proc in self.links:  # their TAP devices go with them
            proc.terminate()
        for proc in self.links:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.links.clear()
        for kind, name in reversed(self.created):
            if kind == "netns":
                _run("ip", "netns", "del", name, check=False)
            elif kind == "iptables":
                _run("iptables", "-D", *self._forward_rule(), check=False)
            else:
                _run("ip", "link", "del", name, check=False)
        self.created.clear()


def nats_server(net: Network, host: int) -> NatsServer:
    routes = tuple(
        f"nats-route://{net.ip(h)}:{ROUTE_PORT}" for h in range(1, NUM_HOSTS + 1) if h != host
    )
    spec = ClusterSpec(f"kvmesh-{net.run_id}", f"host{host}", ROUTE_PORT, routes)
    return NatsServer(
        NATS_PORT,
        host=net.ip(host),
        cluster=spec,
        command_prefix=("ip", "netns", "exec", net.ns(host)),
    )


@dataclass
class Service:
    name: str
    host: int
    argv: tuple[str, ...]
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class NetnsMesh:
    """The running mesh: ``router_url``, ``nats_url`` (every member), its ``network``,
    ``servers`` (host -> NatsServer) and ``services`` (name -> Service)."""

    network: Network
    servers: dict[int, NatsServer]
    services: dict[str, Service]
    log_dir: Path

    @property
    def nats_url(self) -> str:
        return ",".join(f"nats://{self.network.ip(h)}:{NATS_PORT}" for h in range(1, NUM_HOSTS + 1))

    def local_nats_url(self, host: int) -> str:
        """Every member, host's own first (a client prefers it, and falls back to the rest)."""
        order = [host] + [h for h in range(1, NUM_HOSTS + 1) if h != host]
        return ",".join(f"nats://{self.network.ip(h)}:{NATS_PORT}" for h in order)

    @property
    def router_url(self) -> str:
        return f"http://{self.network.ip(1)}:{ROUTER_PORT}"

    def start_service(self, service: Service) -> None:
        log = open(self.log_dir / f"{service.name}.log", "ab")  # noqa: SIM115
        with log:
            service.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.network.ns(service.host), sys.executable, "-m",
                 "kvmesh.cli", *service.argv],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=die_with_parent,
            )  # fmt: skip

    def restart_nats(self, host: int) -> None:
        self.servers[host].stop()
        self.servers[host] = nats_server(self.network, host)
        self.servers[host].start()

    def log_tail(self, name: str, chars: int = 2000) -> str:
        try:
            return (self.log_dir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            proc = service.proc
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for service in self.services.values():
            proc = service.proc
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for server in self.servers.values():
            server.stop()


def _service_argv(
    mesh: NetnsMesh, name: str, role: str, host: int, extra: Sequence[str]
) -> Service:
    argv = ("serve", role, "--worker-id", name, "--nats-url", mesh.local_nats_url(host), *extra)
    return Service(name, host, argv)


@contextlib.contextmanager
def netns_mesh(
    *,
    num_decode: int = 2,
    delay_ms: float = 0.0,
    loss_pct: float = 0.0,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    router_args: Sequence[str] = (),
    startup_timeout_s: float = 120.0,
) -> Iterator[NetnsMesh]:
    """Build the network, the NATS cluster and the mesh; yield it once the router is healthy;
    tear all of it down on exit, however it exits."""
    reason = why_unavailable()
    if reason is not None:
        raise NetnsUnavailableError(reason)
    net = Network(delay_ms, loss_pct)
    log_dir = log_dir or Path(f"/tmp/kvmesh-netns-{net.run_id}")
    log_dir.mkdir(parents=True, exist_ok=True)
    mesh = NetnsMesh(net, {}, {}, log_dir)
    saved = dict(os.environ)
    try:
        net.build()
        for host in range(1, NUM_HOSTS + 1):
            mesh.servers[host] = nats_server(net, host)
            mesh.servers[host].start()
        os.environ.update(env or {})  # children inherit it
        engine = ("--transport", "tcp", "--threads", "1")
        specs = [
            # makes the R3 prefill queue and keeps it through a member's restart (no worker may)
            _service_argv(mesh, "prefill-queue-0", "prefill-queue", 1, ()),
            _service_argv(mesh, "kv-registry-0", "kv-registry", 1, ()),
            _service_argv(mesh, "prefill-0", "prefill", 2, engine),
            *(
                _service_argv(mesh, f"decode-{i}", "decode", 3, engine)
                for i in range(num_decode)
            ),
            _service_argv(
                mesh, "router-0", "router", 1,
                ("--host", net.ip(1), "--port", str(ROUTER_PORT), *router_args),
            ),
        ]  # fmt: skip
        for spec in specs:
            mesh.services[spec.name] = spec
            mesh.start_service(spec)
        _wait_healthy(mesh, startup_timeout_s)
        yield mesh
    finally:
        os.environ.clear()
        os.environ.update(saved)
        mesh.stop()
        net.close()


def _wait_healthy(mesh: NetnsMesh, timeout_s: float) -> None:
    """Until the router's /health counts every decode and prefill worker ready."""
    import json
    import urllib.request

    want_decode = sum(1 for s in mesh.services.values() if s.argv[1] == "decode")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for service in mesh.services.values():
            assert service.proc is not None
            if service.proc.poll() is not None:
                raise RuntimeError(
                    f"{service.name} exited with {service.proc.returncode}:\n"
                    f"{mesh.log_tail(service.name)}"
                )
        try:
            with urllib.request.urlopen(f"{mesh.router_url}/health", timeout=1) as resp:
                counts = json.loads(resp.read())
            if counts["decode_workers"] == want_decode and counts["prefill_workers"] >= 1:
                return
        except (OSError, ValueError, KeyError):
            pass  # not up yet (503 is an HTTPError, an OSError)
        time.sleep(0.3)
    raise TimeoutError(f"the mesh was not healthy within {timeout_s:g}s (logs in {mesh.log_dir})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--decode", type=int, default=2, help="decode workers in host 3")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay on every link")
    p.add_argument("--loss-pct", type=float, default=0.0, help="loss on every link")
    args = p.parse_args()
    try:
        with netns_mesh(
            num_decode=args.decode, delay_ms=args.delay_ms, loss_pct=args.loss_pct
        ) as m:
            print(f"router:  {m.router_url}\nnats:    {m.nats_url}\nlogs:    {m.log_dir}")
            print(f"links:   {m.network.link_kind}")
            for host in range(1, NUM_HOSTS + 1):
                print(
                    f"host {host}: ip netns exec {m.network.ns(host)} ...  ({m.network.ip(host)})"
                )
            print("Ctrl-C tears it down")
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    except NetnsUnavailableError as exc:
        print(f"netns_mesh: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
