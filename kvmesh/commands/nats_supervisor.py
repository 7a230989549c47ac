"""``kvmesh up`` keeps the nats-server it started running, as it keeps its services running.

A nats-server that dies (kill -9, OOM) is restarted after the same backoff as a service
(``RestartPolicy``: 1, 2, 4 ... s, within the ``--max-restarts`` budget), on the same port, with
the same config (one user per role) and the same JetStream store directory, so every client
reconnects to the URL it knows and the admin password file stays valid. Each death and restart is
logged. Meanwhile the services reconnect by themselves and count no silence (shared/bus/hearing.py);
what the mesh does with requests in flight is in docs/faults.md.

A server the launcher found running (an operator's) is the operator's to supervise: this only
watches one it started.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.commands.restarts import RestartPolicy
from kvmesh.shared.bus.nats_server import NatsServer, NatsServerError

NAME = "nats-server"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(eq=False)
class NatsSupervisor:
    """Restarts ``server`` when it exits; ``check`` is called every supervision tick."""

    server: NatsServer
    policy: RestartPolicy
    say: Callable[[str], None] = _say
    restart_at: float | None = None  # when a dead server is due to start again
    num_restarts: int = field(default=0, init=False)

    def check(self, now: float) -> None:
        """Notice a dead server (and reap it) and restart it when its backoff is over.
        NatsServerError when it died more often than the budget allows."""
        code = self.server.exit_code()
        if code is None:
            return
        if self.restart_at is None:
            delay = self.policy.on_exit(NAME, now)
            if delay is None:
                raise NatsServerError(
                    f"the nats-server at {self.server.url} exited with code {code}, "
                    f"{self.policy.restarts(NAME)} times within {self.policy.window_s:g} s; "
                    f"stopping the mesh (its log: {self.log_path})"
                )
            self.say(
                f"kvmesh up: nats-server exited with code {code}; restarting it in {delay:g} s "
                f"at {self.server.url} with its JetStream store (death "
                f"{self.policy.restarts(NAME)} of at most {self.policy.max_restarts} in "
                f"{self.policy.window_s:g} s)"
            )
            self.restart_at = now + delay
        if now < self.restart_at:
            return
        self.restart_at = None
        try:
            self.server.restart()
        except NatsServerError as exc:  # counted as another death at the next check
            self.say(f"kvmesh up: could not restart the nats-server: {exc}")
            return
        self.num_restarts += 1
        self.say(f"kvmesh up: restarted nats-server at {self.server.url} (pid {self.server.pid})")

    @property
    def log_path(self) -> str:
        return str(self.server.log_path or self.server.state_dir / "nats-server.log")
