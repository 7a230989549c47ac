"""NATS users per role on a real nats-server: no credentials, no connection; each role may send
only its own messages (forged aborts, reserves, PrefillDones, admin commands refused by the
server) and read only its own replies; credentials come from the environment, never argv."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
from kvmesh.services.prefill_queue.keeper import ensure_queue
from kvmesh.shared.bus.nats_auth import (
    ROLES,
    MeshCredentials,
    NatsAuth,
    auth_from_env,
    role_permissions,
)
from kvmesh.shared.bus.nats_connect import NatsUnavailableError, connect_nats, flush_to_server
from kvmesh.shared.bus.prefill_job_stream import publish_job
from kvmesh.shared.config.subjects import Subjects
from support.nats_mesh import mesh_server_fixtures

subjects = Subjects("m1")  # the mesh the server's users belong to
other = Subjects("m2")  # another mesh: no role of m1 may use its subjects


creds, server = mesh_server_fixtures(subjects)


async def _delivered(
    server, creds, sender: str, receiver: str, subject: str, listen: str, wait_s: float = 0.5
) -> bool:
    """Whether a message ``sender`` publishes on ``subject`` reaches ``receiver`` on ``listen``.

    No fixed sleep decides it: once the sender's ``flush_to_server`` returns the server has
    routed the message (the receiver's did the same for its SUB first), and the receiver's
    returns only after everything queued for it before its PONG, so a delivered message is
    already in the subscription's queue; a refused one never arrives. (A plain nats-py flush()
    is not enough: its PING can overtake the SUB or PUB just queued, which made this flaky.)"""
    async with (
        connect_nats(server.url, "rx", auth=creds.auth(receiver)) as rx,
        connect_nats(server.url, "tx", auth=creds.auth(sender)) as tx,
    ):
        sub = await rx.subscribe(listen)
        await flush_to_server(rx)
        await tx.publish(subject, b"x")
        await flush_to_server(tx)
        await flush_to_server(rx)
        try:
            await sub.next_msg(timeout=wait_s)  # already queued if delivered
        except TimeoutError:
            return False
        return True


async def _reserve(registry, decode, subject: str):
    """The registry's reserve request to the decode worker subscribed on ``subject``. A "no
    responders" answer is retried twice after flushing the decode side again: CI saw one on a
    loaded box although decode had subscribed and flushed (not what these tests are about)."""
    for attempt in range(3):
        try:
            return await registry.request(subject, b"r1", timeout=10)
        except nats.errors.NoRespondersError:
            if attempt == 2:
                raise
            await flush_to_server(decode)
            await asyncio.sleep(0.2)
    raise AssertionError("unreachable")


async def test_nats_without_credentials_or_with_a_wrong_password_is_refused(server, creds):
    with pytest.raises(NatsUnavailableError, match="refused no credentials"):
        async with connect_nats(server.url, "anon", connect_wait_s=2.0, auth=None):
            pass
    with pytest.raises(NatsUnavailableError, match="refused user 'router'"):
        async with connect_nats(server.url, "x", connect_wait_s=2.0, auth=NatsAuth("router", "no")):
            pass


@pytest.mark.parametrize(
    ("sender", "subject", "listener", "listen", "allowed"),
    [
        ("router", subjects.ABORT, "decode", subjects.ABORT, True),
        ("prefill", subjects.ABORT, "decode", subjects.ABORT, False),  # forged abort
        ("kv-registry", subjects.decode_reserve("d0"), "decode", "kvmesh.m1.decode.d0.>", True),
        ("router", subjects.decode_reserve("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        ("prefill", subjects.decode_prefill_done("d0"), "decode", "kvmesh.m1.decode.d0.>", True),
        ("router", subjects.decode_prefill_done("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        ("decode", subjects.decode_lease_renew("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        ("admin", subjects.ADMIN_DRAIN, "kv-registry", subjects.ADMIN_DRAIN, True),
        ("router", subjects.ADMIN_DRAIN, "kv-registry", subjects.ADMIN_DRAIN, False),
        ("prefill", subjects.heartbeat("decode", "d0"), "router", "kvmesh.m1.heartbeat.>", False),
        ("decode", subjects.request_tokens("r1"), "router", "kvmesh.m1.request.>", True),
        ("prefill", subjects.request_tokens("r1"), "router", "kvmesh.m1.request.>", False),
        # speculative decoding: contexts from decode to draft, proposals back, nothing else
        ("decode", subjects.DRAFT_CONTEXT, "draft", subjects.DRAFT_CONTEXT, True),
        ("decode", subjects.draft_context("x0"), "draft", subjects.draft_context("*"), True),
        ("colocated", subjects.draft_forget("x0"), "draft", subjects.draft_forget("*"), True),
        ("draft", subjects.decode_draft("d0"), "decode", "kvmesh.m1.decode.d0.>", True),
        ("router", subjects.decode_draft("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        ("draft", subjects.ABORT, "decode", subjects.ABORT, False),
        ("draft", subjects.request_tokens("r1"), "router", "kvmesh.m1.request.>", False),
        ("draft", subjects.decode_reserve("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        ("prefill", subjects.DRAFT_CONTEXT, "draft", subjects.DRAFT_CONTEXT, False),
        # prefix cache events: decode workers tell the registry what they hold, nobody else may
        ("decode", subjects.REGISTRY_KV_EVENTS, "kv-registry", subjects.REGISTRY_KV_EVENTS, True),
        (
            "colocated",
            subjects.REGISTRY_KV_DIGEST,
            "kv-registry",
            subjects.REGISTRY_KV_DIGEST,
            True,
        ),
        ("prefill", subjects.REGISTRY_KV_EVENTS, "kv-registry", subjects.REGISTRY_KV_EVENTS, False),
        ("router", subjects.REGISTRY_KV_DIGEST, "kv-registry", subjects.REGISTRY_KV_DIGEST, False),
        # KV stores: adverts to the registry and prefill workers, put/get from their clients;
        # they hear the registry drop a worker (and evict its blocks)
        (
            "kv-registry",
            subjects.REGISTRY_WORKER_GONE,
            "kv-store",
            subjects.REGISTRY_WORKER_GONE,
            True,
        ),
        (
            "kv-store",
            subjects.REGISTRY_STORE_ADVERTISE,
            "kv-registry",
            subjects.REGISTRY_STORE_ADVERTISE,
            True,
        ),
        (
            "kv-store",
            subjects.REGISTRY_STORE_ADVERTISE,
            "prefill",
            subjects.REGISTRY_STORE_ADVERTISE,
            True,
        ),
        (
            "decode",
            subjects.REGISTRY_STORE_ADVERTISE,
            "prefill",
            subjects.REGISTRY_STORE_ADVERTISE,
            False,
        ),
        # a starting store reader asks every store to advertise at once; only readers may ask
        (
            "prefill",
            subjects.REGISTRY_STORE_SOLICIT,
            "kv-store",
            subjects.REGISTRY_STORE_SOLICIT,
            True,
        ),
        (
            "decode",
            subjects.REGISTRY_STORE_SOLICIT,
            "kv-store",
            subjects.REGISTRY_STORE_SOLICIT,
            True,
        ),
        (
            "kv-registry",
            subjects.REGISTRY_STORE_SOLICIT,
            "kv-store",
            subjects.REGISTRY_STORE_SOLICIT,
            True,
        ),
        (
            "router",
            subjects.REGISTRY_STORE_SOLICIT,
            "kv-store",
            subjects.REGISTRY_STORE_SOLICIT,
            False,
        ),
        (
            "draft",
            subjects.REGISTRY_STORE_SOLICIT,
            "kv-store",
            subjects.REGISTRY_STORE_SOLICIT,
            False,
        ),
        # what a store holds: only stores tell the registry, on subjects of their own
        (
            "kv-store",
            subjects.REGISTRY_STORE_KV_EVENTS,
            "kv-registry",
            subjects.REGISTRY_STORE_KV_EVENTS,
            True,
        ),
        (
            "kv-store",
            subjects.REGISTRY_STORE_KV_DIGEST,
            "kv-registry",
            subjects.REGISTRY_STORE_KV_DIGEST,
            True,
        ),
        (
            "kv-store",
            subjects.REGISTRY_KV_EVENTS,
            "kv-registry",
            subjects.REGISTRY_KV_EVENTS,
            False,
        ),
        (
            "decode",
            subjects.REGISTRY_STORE_KV_EVENTS,
            "kv-registry",
            subjects.REGISTRY_STORE_KV_EVENTS,
            False,
        ),
        ("prefill", subjects.store_put("s0"), "kv-store", "kvmesh.m1.store.s0.>", True),
        ("decode", subjects.store_get("s0"), "kv-store", "kvmesh.m1.store.s0.>", True),
        ("router", subjects.store_put("s0"), "kv-store", "kvmesh.m1.store.s0.>", False),
        ("kv-store", subjects.ABORT, "decode", subjects.ABORT, False),
        ("kv-store", subjects.decode_reserve("d0"), "decode", "kvmesh.m1.decode.d0.>", False),
        # another mesh's subjects: neither sent nor heard
        ("router", other.ABORT, "decode", other.ABORT, False),
        ("decode", other.request_tokens("r1"), "router", other.request_events_all("r1"), False),
        ("admin", other.ADMIN_DRAIN, "kv-registry", other.ADMIN_DRAIN, False),
    ],
)
async def test_role_may_send_only_its_own_messages(
    server, creds, sender, subject, listener, listen, allowed
):
    # an allowed message gets longer: a miss is then never a slow box
    wait_s = 5.0 if allowed else 0.5
    assert await _delivered(server, creds, sender, listener, subject, listen, wait_s) is allowed


@pytest.mark.parametrize("reader", ["decode", "prefill", "router", "colocated"])
async def test_jobs_and_other_roles_replies_cannot_be_read(server, creds, reader):
    """A job and a ReserveReply carry a lease's window key: no other role reads them."""
    assert not await _delivered(
        server, creds, "router", reader, subjects.PREFILL_JOBS, subjects.PREFILL_JOBS
    )
    snooped: list[bytes] = []

    async def snoop(msg) -> None:
        snooped.append(msg.data)

    async def on_reserve(msg) -> None:
        await msg.respond(b"window-key")

    async with (
        connect_nats(server.url, "d", auth=creds.auth("decode")) as decode,
        connect_nats(server.url, "r", auth=creds.auth("kv-registry")) as registry,
        connect_nats(server.url, "s", auth=creds.auth(reader)) as snooper,
    ):
        for listen in ("_INBOX.>", "_INBOX_kv-registry.>", ">"):
            await snooper.subscribe(listen, cb=snoop)
        await flush_to_server(snooper)
        await decode.subscribe(subjects.decode_reserve("d1"), cb=on_reserve)
        await flush_to_server(decode)
        reply = await _reserve(registry, decode, subjects.decode_reserve("d1"))
        await asyncio.sleep(0.2)
    assert reply.data == b"window-key" and snooped == []


async def test_request_reply_works_within_permissions(server, creds):
    """kv-registry reserves on a decode worker and reads the reply in its own inbox."""
    async with (
        connect_nats(server.url, "d", auth=creds.auth("decode")) as decode,
        connect_nats(server.url, "r", auth=creds.auth("kv-registry")) as registry,
    ):

        async def on_reserve(msg) -> None:
            await msg.respond(b"ok:" + msg.data)

        await decode.subscribe(subjects.decode_reserve("d0"), cb=on_reserve)
        await flush_to_server(decode)
        reply = await _reserve(registry, decode, subjects.decode_reserve("d0"))
        assert reply.data == b"ok:r1"


def test_credentials_come_from_the_environment_or_a_password_file(tmp_path):
    assert auth_from_env({}) is None
    env = NatsAuth("router", "pw").env()
    assert auth_from_env(env) == NatsAuth("router", "pw")
    secret = tmp_path / "admin.password"
    secret.write_text("s3cret\n")
    found = auth_from_env({"KVMESH_NATS_USER": "admin", "KVMESH_NATS_PASSWORD_FILE": str(secret)})
    assert found == NatsAuth("admin", "s3cret") and found.inbox_prefix == "_INBOX_admin"
    with pytest.raises(ValueError, match="KVMESH_NATS_PASSWORD"):
        auth_from_env({"KVMESH_NATS_USER": "admin"})


async def test_prefill_queue_of_another_mesh_is_out_of_reach(server, creds):
    """admin makes its own mesh's stream, not another's; the router publishes jobs into its
    own."""
    async with (
        connect_nats(server.url, "a", auth=creds.auth("admin")) as admin,
        connect_nats(server.url, "r", auth=creds.auth("router")) as router,
    ):
        await ensure_queue(admin, subjects)
        assert await publish_job(router, subjects, b"job") >= 1
        with pytest.raises(Exception):  # noqa: B017  (denied: the JetStream API times out)
            await asyncio.wait_for(ensure_queue(admin, other), 3.0)
    assert any("KVMESH_PREFILL_m2" in line for line in server.permission_violations())


def test_every_role_has_a_distinct_password_and_its_own_inbox(creds):
    permissions = role_permissions(subjects)
    assert set(creds.passwords) == set(permissions) == set(ROLES)
    assert len(set(creds.passwords.values())) == len(ROLES)
    for role in ROLES:
        if role != "admin":
            assert permissions[role].subscribe[0] == f"_INBOX_{role}.>"
        granted = permissions[role].publish + permissions[role].subscribe
        assert not [g for g in granted if g.startswith("kvmesh.") and ".m1." not in g + "."]
    config = creds.server_config(subjects)
    assert config.startswith("# kvmesh mesh 'm1'\nauthorization {")
    assert "allow_responses: true" in config
    assert all(f'password: "{pw}"' in config for pw in creds.passwords.values())


def test_generated_passwords_start_with_a_letter_and_stay_url_safe():
    import string

    from kvmesh.shared.bus.nats_auth import new_password

    allowed = set(string.ascii_letters + string.digits + "-_")
    passwords = [new_password() for _ in range(2000)]
    assert all(p[0].isascii() and p[0].isalpha() for p in passwords)
    assert all(len(p) == 32 and set(p) <= allowed for p in passwords)
    assert len(set(passwords)) == len(passwords)


def test_nats_server_reads_generated_passwords_through_config_variables_as_strings(tmp_path):
    """deploy/nats-auth.conf takes each role's password from ``$KVMESH_NATS_PASSWORD_<ROLE>``,
    and nats-server parses a variable's value as a config value: one that starts with a digit
    or "-" is refused or read as a number (compose stacks then failed to start, now and then).
    ``nats-server -t`` checks the config with the variables set."""
    import os
    import subprocess

    from kvmesh.shared.bus.nats_auth import authorization_block
    from kvmesh.shared.bus.nats_server import nats_server_binary

    conf = tmp_path / "nats-auth.conf"
    conf.write_text(authorization_block(Subjects("zz9"), None))

    def check(env_lines: str) -> int:
        env = dict(line.split("=", 1) for line in env_lines.splitlines())
        argv = [str(nats_server_binary()), "-c", str(conf), "-t"]
        return subprocess.run(argv, env={**os.environ, **env}, capture_output=True).returncode

    for _ in range(20):
        assert check(MeshCredentials.generate().env_file()) == 0
    numeric = MeshCredentials.generate()
    numeric = MeshCredentials({**numeric.passwords, "router": "12K"})
    assert check(numeric.env_file()) != 0  # what a digit-led password did
