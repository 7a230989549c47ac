"""Who may say what on the control plane: NATS users per role, their permissions, credentials.

A mesh that ``kvmesh up`` starts on its own nats-server runs it with one user per role (router,
kv-registry, decode, colocated, prefill) plus ``admin`` for the operator, each with a random
password and the permissions below; a client with no credentials cannot connect at all. Each
role may use only its mesh's subjects (``kvmesh.<mesh>.``) and JetStream stream; it may publish
only the messages it sends and subscribe only to what it reads, so a prefill
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
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvmesh.shared.config.subjects import Subjects

USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV = (
    "KVMESH_NATS_USER",
    "KVMESH_NATS_PASSWORD",
    "KVMESH_NATS_PASSWORD_FILE",
)
ADMIN = "admin"
QUEUE_KEEPER = "prefill-queue"
ROLES = (
    "router",
    "kv-registry",
    "decode",
    "colocated",
    "prefill",
    "draft",
    "kv-store",
    QUEUE_KEEPER,
    ADMIN,
)


@dataclass(frozen=True, slots=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(user: str) -> str:
    """Where replies to ``user``'s requests arrive; only ``user`` may subscribe there."""
    return f"_INBOX_{user}"


def jetstream_api(s: Subjects) -> tuple[str, ...]:
    """The whole JetStream API of the mesh's own prefill stream and its consumers (the
    operator's), and nothing of any other stream."""
    stream = s.PREFILL_STREAM
    return (
        f"$JS.API.STREAM.*.{stream}",
        f"$JS.API.STREAM.MSG.*.{stream}",
        f"$JS.API.CONSUMER.*.{stream}",
        f"$JS.API.CONSUMER.*.{stream}.>",
        f"$JS.API.CONSUMER.*.*.{stream}.>",
        f"$JS.API.DIRECT.GET.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.>",
    )


def jetstream_keeper_api(s: Subjects) -> tuple[str, ...]:
    """What the prefill-queue keeper needs to watch the mesh's stream and its durable consumer:
    their INFO, nothing that creates or changes them. A user that could create or update the
    stream could give it subjects and a ``republish`` rule to its own inbox and read every
    message of the mesh (issue 40); ``admin`` makes them (services/prefill_queue/keeper.py)."""
    stream, durable = s.PREFILL_STREAM, "prefill"  # shared/prefill_queue.DURABLE
    return (
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
    )


def jetstream_worker_api(s: Subjects) -> tuple[str, ...]:
    """What a prefill worker needs to take jobs: the durable consumer's info, its pulls and the
    acknowledgements of what it took. Nothing that creates, changes or deletes."""
    stream, durable = s.PREFILL_STREAM, "prefill"
    return (
        f"$JS.API.CONSUMER.INFO.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    )


def role_permissions(s: Subjects) -> dict[str, Permissions]:
    """Each role's permissions on mesh ``s.mesh``: only that mesh's subjects and stream."""
    p = s.prefix

    def service(role: str, publish: tuple[str, ...], subscribe: tuple[str, ...]) -> Permissions:
        """Every service heartbeats as its role, follows log-level changes, answers discovery."""
        return Permissions(
            publish=(f"{p}.heartbeat.{role}.*", *publish),
            subscribe=(f"{inbox_prefix(role)}.>", s.CONTROL_LOG_LEVEL, "$SRV.>", *subscribe),
        )

    # a kv-store's clients: put, commit, get and release are requests (replies to their inbox)
    store_client = (
        s.store_put("*"),
        s.store_commit("*"),
        s.store_get("*"),
        s.store_release("*"),
    )
    decode_pub = (
        *store_client,
        f"{p}.request.*.tokens",
        s.REGISTRY_ADVERTISE,
        s.REGISTRY_KV_EVENTS,
        s.REGISTRY_KV_DIGEST,
        s.REGISTRY_STORE_SOLICIT,
        s.ABORT,
        s.DRAFT_CONTEXT,
        s.draft_context("*"),
        s.draft_forget("*"),
    )
    decode_sub = (
        f"{p}.decode.*.>",
        f"{p}.worker.*.control",
        s.ABORT,
        s.REGISTRY_WORKER_GONE,
        s.REGISTRY_STORE_ADVERTISE,
        s.STREAM_LOOKUP,  # which worker holds a stream a client resumes
    )
    stream = s.PREFILL_STREAM
    return {
        "router": service(
            "router",
            publish=(
                s.REGISTRY_PLACE,
                s.ABORT,
                s.DECODE_LEASE_RENEW_ALL,
                f"{p}.request.*.worker_gone",
                s.PREFILL_JOBS,  # jobs into the stream (its acks come to the router's inbox)
                f"$JS.API.STREAM.MSG.DELETE.{stream}",  # withdraw_job: shared/bus/prefill_job_stream.py
                s.STREAM_LOOKUP,  # a client resumes a stream: who holds it, its events so far
                s.decode_stream_resume("*"),
            ),
            subscribe=(
                f"{p}.request.>",
                s.REGISTRY_WORKER_GONE,
                s.REGISTRY_ADVERTISE,
                s.HEARTBEAT_ALL,
            ),
        ),
        "kv-registry": service(
            "kv-registry",
            publish=(
                f"{p}.decode.*.reserve",
                s.decode_lease_cancel("*"),
                f"{p}.worker.*.control",
                s.CONTROL_LOG_LEVEL,
                s.REGISTRY_WORKER_GONE,
                s.REGISTRY_STORE_SOLICIT,
                f"$JS.API.STREAM.INFO.{stream}",  # the queue's depth in admin status
            ),
            subscribe=(
                s.REGISTRY_PLACE,
                s.REGISTRY_ADVERTISE,
                s.REGISTRY_KV_EVENTS,
                s.REGISTRY_KV_DIGEST,
                s.REGISTRY_STORE_ADVERTISE,
                s.REGISTRY_STORE_KV_EVENTS,
                s.REGISTRY_STORE_KV_DIGEST,
                s.HEARTBEAT_ALL,
                s.decode_prefill_done("*"),
                s.DECODE_LEASE_RENEW_ALL,
                f"{p}.admin.>",
            ),
        ),
        "decode": service("decode", decode_pub, decode_sub),
        "colocated": service("colocated", decode_pub, decode_sub),
        "prefill": service(
            "prefill",
            publish=(
                s.decode_prefill_done("*"),
                s.decode_prefill_started("*"),
                s.DRAFT_KV_RESERVE,
                s.draft_kv_done("*"),
                f"{p}.request.*.prefill",
                f"{p}.request.*.prefill_started",
                s.REGISTRY_STORE_SOLICIT,
                *store_client,
                *jetstream_worker_api(s),
            ),
            subscribe=(
                s.ABORT,
                s.REGISTRY_WORKER_GONE,  # a gone router's jobs stop
                s.REGISTRY_ADVERTISE,
                s.REGISTRY_STORE_ADVERTISE,
                f"{p}.worker.*.control",
            ),
        ),
        # Draft workers: read contexts (the queue group's and their own), prompt-KV reservations
        # and their dones, and aborts, answer their status and control (drain) endpoints; send proposals to decode
        # workers, nothing else (reservation replies go to the prefill's inbox).
        "draft": service(
            "draft",
            publish=(s.decode_draft("*"),),
            subscribe=(
                s.DRAFT_CONTEXT,
                s.draft_context("*"),
                s.draft_forget("*"),
                s.draft_status("*"),
                s.DRAFT_KV_RESERVE,
                s.draft_kv_done("*"),
                s.ABORT,
                s.REGISTRY_WORKER_GONE,
                f"{p}.worker.*.control",
            ),
        ),
        # KV stores: answer their own endpoints (put, commit, get, release), advertise
        # themselves (every heartbeat, and at once when a starting reader solicits it) and what
        # they hold, evict the blocks of workers the kv-registry drops, and answer the
        # registry's drain/resume; they send nothing else and read no other role's messages.
        "kv-store": service(
            "kv-store",
            publish=(
                s.REGISTRY_STORE_ADVERTISE,
                s.REGISTRY_STORE_KV_EVENTS,
                s.REGISTRY_STORE_KV_DIGEST,
            ),
            subscribe=(
                f"{p}.store.*.>",
                f"{p}.worker.*.control",
                s.REGISTRY_STORE_SOLICIT,
                s.REGISTRY_WORKER_GONE,
            ),
        ),
        # The prefill-queue keeper (services/prefill_queue/): watches the stream and its
        # consumer (INFO only); reads nothing but the API's answers. No runtime role may create
        # or update them: one that could would give the stream a republish rule, and the server
        # would publish any message of the mesh, or anything it sends, under its own identity.
        QUEUE_KEEPER: Permissions(
            publish=("$JS.API.INFO", *jetstream_keeper_api(s)),
            subscribe=(f"{inbox_prefix(QUEUE_KEEPER)}.>",),
        ),
        # The operator: the mesh's admin requests and discovery, and all of its JetStream
        # stream; may watch everything of the mesh (kvmesh bench taps it) and its own replies.
        ADMIN: Permissions(
            publish=(f"{p}.admin.>", "$SRV.>", "$JS.API.INFO", *jetstream_api(s)),
            subscribe=(f"{p}.>", f"{inbox_prefix(ADMIN)}.>", "$SRV.>"),
        ),
    }


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
        try:
            password = Path(env[PASSWORD_FILE_ENV]).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"{PASSWORD_FILE_ENV}={env[PASSWORD_FILE_ENV]}: cannot be read ({exc.strerror})"
            ) from None
    if not password:
        raise ValueError(
            f"{USER_ENV}={user} is set but neither {PASSWORD_ENV} nor {PASSWORD_FILE_ENV} is"
        )
    return NatsAuth(user, password)


def new_password() -> str:
    """A random password (32 url-safe characters, about 190 random bits) that starts with a letter.
    nats-server reads a ``$VARIABLE`` of its config (deploy/nats-auth.conf's passwords) as a
    config value: one starting with a digit or "-" is parsed as a number and refused ("Expected a
    digit"), or taken as one (a size such as 12K)."""
    return secrets.choice(string.ascii_letters) + secrets.token_urlsafe(24)[:31]


@dataclass(frozen=True, slots=True)
class MeshCredentials:
    """A random password per role, for one mesh's nats-server."""

    passwords: Mapping[str, str]

    @classmethod
    def generate(cls) -> MeshCredentials:
        return cls({role: new_password() for role in ROLES})

    def auth(self, role: str) -> NatsAuth:
        if role not in self.passwords:
            raise KeyError(f"no NATS user for role {role!r}; roles: {', '.join(ROLES)}")
        return NatsAuth(role, self.passwords[role])

    def server_config(self, subjects: Subjects) -> str:
        """The nats-server ``authorization`` block of mesh ``subjects.mesh`` with these
        passwords."""
        quoted = {role: json.dumps(pw) for role, pw in self.passwords.items()}
        return authorization_block(subjects, quoted)

    def env_file(self) -> str:
        """``KVMESH_NATS_PASSWORD_<ROLE>=...`` lines: a compose ``.env`` for deploy/nats-auth.conf."""
        return "".join(f"{password_variable(r)}={pw}\n" for r, pw in self.passwords.items())


def password_variable(role: str) -> str:
    """The environment variable deploy/nats-auth.conf reads ``role``'s password from."""
    return f"KVMESH_NATS_PASSWORD_{role.upper().replace('-', '_')}"


def authorization_block(subjects: Subjects, passwords: Mapping[str, str] | None = None) -> str:
    """nats-server config: one user per role with its permissions on mesh ``subjects.mesh``.
    ``passwords`` maps a role to its password as a config value (a quoted string); None
    references environment variables (``$KVMESH_NATS_PASSWORD_ROUTER``, ...), which nats-server
    resolves when it starts."""
    lines = [f"# kvmesh mesh {subjects.mesh!r}", "authorization {", "  users = ["]
    for role, perms in role_permissions(subjects).items():
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
