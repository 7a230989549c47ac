"""Who may say what on the control plane: NATS users per role, their permissions, credentials.

A mesh that ``kvmesh up`` starts on its own nats-server runs it with one user per role (router,
kv-registry, decode, colocated, prefill) plus ``admin`` for the operator, each with a random
password and the permissions below; a client with no credentials cannot connect at all. Each
role may publish only the messages it sends and subscribe only to what it reads, so a prefill
worker cannot abort requests, only the kv-registry can reserve decode blocks, only the router
can renew leases and only ``admin`` can drain workers. Replies to requests go out under
``allow_responses``; each role has its own reply-inbox prefix, so no role reads another's
replies (a ReserveReply carries a lease's window key). docs/security.md shows the same table as
an operator puts it into an external server's config.

Services take their credentials from the environment: ``KVMESH_NATS_USER`` and
``KVMESH_NATS_PASSWORD`` (or ``KVMESH_NATS_PASSWORD_FILE``, a file holding it); never from the
command line, which other local users can read in ``ps``.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.subjects import PREFIX

P = PREFIX
USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV = (
    "KVMESH_NATS_USER",
    "KVMESH_NATS_PASSWORD",
    "KVMESH_NATS_PASSWORD_FILE",
)
ADMIN = "admin"
JETSTREAM = ("$JS.API.>",)  # stream and consumer management, publish acks


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(user: str) -> str:
    """Where replies to ``user``'s requests arrive; only ``user`` may subscribe there."""
    return f"_INBOX_{user}"


def _service(role: str, publish: tuple[str, ...], subscribe: tuple[str, ...]) -> Permissions:
    """Every service heartbeats as its role, follows log-level changes and answers discovery."""
    return Permissions(
        publish=(f"{P}.heartbeat.{role}.*", *publish),
        subscribe=(
            f"{inbox_prefix(role)}.>",
            f"{P}.control.log_level",
            "$SRV.>",
            *subscribe,
        ),
    )


_DECODE_PUB = (f"{P}.request.*.tokens", f"{P}.registry.advertise", f"{P}.abort")
_DECODE_SUB = (
    f"{P}.decode.*.>",
    f"{P}.worker.*.control",
    f"{P}.abort",
    f"{P}.registry.worker_gone",
)

ROLE_PERMISSIONS: Mapping[str, Permissions] = {
    "router": _service(
        "router",
        publish=(
            f"{P}.registry.place",
            f"{P}.abort",
            f"{P}.decode.*.lease_renew",
            f"{P}.request.*.worker_gone",
            f"{P}.prefill.jobs",
            *JETSTREAM,
        ),
        subscribe=(
            f"{P}.request.>",
            f"{P}.registry.worker_gone",
            f"{P}.registry.advertise",
            f"{P}.heartbeat.>",
        ),
    ),
    "kv-registry": _service(
        "kv-registry",
        publish=(
            f"{P}.decode.*.reserve",
            f"{P}.worker.*.control",
            f"{P}.control.log_level",
            f"{P}.registry.worker_gone",
            *JETSTREAM,
        ),
        subscribe=(
            f"{P}.registry.place",
            f"{P}.registry.advertise",
            f"{P}.heartbeat.>",
            f"{P}.decode.*.prefill_done",
            f"{P}.decode.*.lease_renew",
            f"{P}.admin.>",
        ),
    ),
    "decode": _service("decode", _DECODE_PUB, _DECODE_SUB),
    "colocated": _service("colocated", _DECODE_PUB, _DECODE_SUB),
    "prefill": _service(
        "prefill",
        publish=(
            f"{P}.decode.*.prefill_done",
            f"{P}.decode.*.prefill_started",
            f"{P}.request.*.prefill",
            f"{P}.request.*.prefill_started",
            *JETSTREAM,
        ),
        subscribe=(f"{P}.abort", f"{P}.registry.advertise", f"{P}.worker.*.control"),
    ),
    # The operator: admin requests and discovery, and may watch everything (kvmesh bench taps).
    ADMIN: Permissions(publish=(f"{P}.admin.>", "$SRV.>"), subscribe=(">",)),
}
ROLES = tuple(ROLE_PERMISSIONS)


@dataclass(frozen=True, slots=True)
class NatsAuth:
    """One client's credentials (user = role)."""

    user: str
    password: str

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)

    def env(self) -> dict[str, str]:
        """What a child process needs in its environment to connect as this user."""
        return {USER_ENV: self.user, PASSWORD_ENV: self.password}

    def connect_options(self) -> dict[str, str]:
        """Keyword arguments of ``nats.aio.client.Client.connect``."""
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}


def auth_from_env(environ: Mapping[str, str] | None = None) -> NatsAuth | None:
    """The credentials in the environment, or None when there are none (an open server)."""
    env = os.environ if environ is None else environ
    user = env.get(USER_ENV)
    if not user:
        return None
    password = env.get(PASSWORD_ENV)
    if password is None and env.get(PASSWORD_FILE_ENV):
        password = Path(env[PASSWORD_FILE_ENV]).read_text().strip()
    if not password:
        raise ValueError(
            f"{USER_ENV}={user} is set but neither {PASSWORD_ENV} nor {PASSWORD_FILE_ENV} is"
        )
    return NatsAuth(user, password)


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    """A random password per role, for one mesh's nats-server."""

    passwords: Mapping[str, str]

    @classmethod
    def generate(cls) -> MeshCredentials:
        return cls({role: secrets.token_urlsafe(24) for role in ROLES})

    def auth(self, role: str) -> NatsAuth:
        if role not in self.passwords:
            raise KeyError(f"no NATS user for role {role!r}; roles: {', '.join(ROLES)}")
        return NatsAuth(role, self.passwords[role])

    def server_config(self) -> str:
        """The nats-server ``authorization`` block with these passwords."""
        return authorization_block({role: json.dumps(pw) for role, pw in self.passwords.items()})

    def env_file(self) -> str:
        """``KVMESH_NATS_PASSWORD_<ROLE>=...`` lines: a compose ``.env`` for deploy/nats-auth.conf."""
        return "".join(f"{password_variable(r)}={pw}\n" for r, pw in self.passwords.items())


def password_variable(role: str) -> str:
    """The environment variable deploy/nats-auth.conf reads ``role``'s password from."""
    return f"KVMESH_NATS_PASSWORD_{role.upper().replace('-', '_')}"


def authorization_block(passwords: Mapping[str, str] | None = None) -> str:
    """nats-server config: one user per role with its permissions. ``passwords`` maps a role to
    its password as a config value (a quoted string); None references environment variables
    (``$KVMESH_NATS_PASSWORD_ROUTER``, ...), which nats-server resolves when it starts."""
    lines = ["authorization {", "  users = ["]
    for role, perms in ROLE_PERMISSIONS.items():
        password = passwords[role] if passwords is not None else f"${password_variable(role)}"
        lines += [
            "    {",
            f"      user: {json.dumps(role)}",
            f"      password: {password}",
            "      permissions: {",
            f"        publish: {{ allow: {json.dumps(list(perms.publish))} }}",
            f"        subscribe: {{ allow: {json.dumps(list(perms.subscribe))} }}",
            "        allow_responses: true",
            "      }",
            "    }",
        ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)
