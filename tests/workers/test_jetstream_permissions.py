"""Every JetStream API verb, tried as every NATS user of a mesh against a real nats-server with
the mesh's permissions (shared/bus/nats_auth.py): which reach the API and which the server refuses.

No worker or router role may create, update or delete a stream or a consumer: a role that could
update the prefill stream could give it a ``republish`` rule, and the server would republish any
job it sends under the server's own identity (as prefill, an ``admin.drain`` drained a decode
worker: issue 27). Nor may the keeper (user ``prefill-queue``): it reads their INFO and nothing
else (issue 40: with UPDATE it added ``request.*.tokens`` and ``registry.advertise`` to the
stream with a ``republish`` to its own inbox and read another tenant's tokens and decode's lane
secret). The operator (``admin``) makes them and holds the whole API of the mesh's stream. The
tables below are the policy, written out; the server is asked, not the permission lists."""

from __future__ import annotations

import asyncio

import nats
import orjson
import pytest
from kvmesh.services.prefill_queue.keeper import ensure_queue
from kvmesh.shared.bus.nats_auth import ROLES, MeshCredentials
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.bus.prefill_job_stream import DURABLE, publish_job, stream_config
from kvmesh.shared.config.subjects import Subjects
from support.nats_mesh import mesh_server_fixtures

subjects = Subjects("js1")
other = Subjects("js2")
S, O = subjects.PREFILL_STREAM, other.PREFILL_STREAM

# verb -> the API subject it is asked on (the mesh's stream, its consumer; another mesh's)
VERBS = {
    "INFO": "$JS.API.INFO",
    "STREAM.CREATE": f"$JS.API.STREAM.CREATE.{S}",
    "STREAM.UPDATE": f"$JS.API.STREAM.UPDATE.{S}",
    "STREAM.DELETE": f"$JS.API.STREAM.DELETE.{S}",
    "STREAM.INFO": f"$JS.API.STREAM.INFO.{S}",
    "STREAM.LIST": "$JS.API.STREAM.LIST",
    "STREAM.NAMES": "$JS.API.STREAM.NAMES",
    "STREAM.PURGE": f"$JS.API.STREAM.PURGE.{S}",
    "STREAM.SNAPSHOT": f"$JS.API.STREAM.SNAPSHOT.{S}",
    "STREAM.RESTORE": f"$JS.API.STREAM.RESTORE.{S}",
    "STREAM.MSG.GET": f"$JS.API.STREAM.MSG.GET.{S}",
    "STREAM.MSG.DELETE": f"$JS.API.STREAM.MSG.DELETE.{S}",
    "STREAM.LEADER.STEPDOWN": f"$JS.API.STREAM.LEADER.STEPDOWN.{S}",
    "STREAM.PEER.REMOVE": f"$JS.API.STREAM.PEER.REMOVE.{S}",
    "DIRECT.GET": f"$JS.API.DIRECT.GET.{S}",
    "CONSUMER.CREATE": f"$JS.API.CONSUMER.CREATE.{S}.{DURABLE}",
    "CONSUMER.CREATE.other": f"$JS.API.CONSUMER.CREATE.{S}.spy",
    "CONSUMER.DURABLE.CREATE": f"$JS.API.CONSUMER.DURABLE.CREATE.{S}.{DURABLE}",
    "CONSUMER.DURABLE.CREATE.other": f"$JS.API.CONSUMER.DURABLE.CREATE.{S}.spy",
    "CONSUMER.DELETE": f"$JS.API.CONSUMER.DELETE.{S}.{DURABLE}",
    "CONSUMER.INFO": f"$JS.API.CONSUMER.INFO.{S}.{DURABLE}",
    "CONSUMER.LIST": f"$JS.API.CONSUMER.LIST.{S}",
    "CONSUMER.NAMES": f"$JS.API.CONSUMER.NAMES.{S}",
    "CONSUMER.MSG.NEXT": f"$JS.API.CONSUMER.MSG.NEXT.{S}.{DURABLE}",
    "CONSUMER.LEADER.STEPDOWN": f"$JS.API.CONSUMER.LEADER.STEPDOWN.{S}.{DURABLE}",
    "CONSUMER.PAUSE": f"$JS.API.CONSUMER.PAUSE.{S}.{DURABLE}",
    "ACCOUNT.PURGE": "$JS.API.ACCOUNT.PURGE.$G",
    "META.LEADER.STEPDOWN": "$JS.API.META.LEADER.STEPDOWN",
    "SERVER.REMOVE": "$JS.API.SERVER.REMOVE",
    "other.STREAM.INFO": f"$JS.API.STREAM.INFO.{O}",
    "other.STREAM.UPDATE": f"$JS.API.STREAM.UPDATE.{O}",
    "other.STREAM.MSG.DELETE": f"$JS.API.STREAM.MSG.DELETE.{O}",
    "other.CONSUMER.INFO": f"$JS.API.CONSUMER.INFO.{O}.{DURABLE}",
    "other.CONSUMER.MSG.NEXT": f"$JS.API.CONSUMER.MSG.NEXT.{O}.{DURABLE}",
}
# a body for the verbs that would otherwise wait (a pull with nothing to take answers at once)
BODIES = {"CONSUMER.MSG.NEXT": b'{"batch": 1, "no_wait": true}', "STREAM.MSG.DELETE": b'{"seq": 1}'}
OPERATOR = {
    v for v in VERBS if not v.startswith("other.") and v.split(".")[0] in ("STREAM", "CONSUMER")
} - {"STREAM.LIST", "STREAM.NAMES", "STREAM.LEADER.STEPDOWN", "STREAM.PEER.REMOVE"}
ALLOWED = {
    "router": {"STREAM.MSG.DELETE"},  # withdraw_job; an Abort does as much to any request
    "kv-registry": {"STREAM.INFO"},  # the queue's depth in `kvmesh admin status`
    "decode": set(),
    "colocated": set(),
    "prefill": {"CONSUMER.INFO", "CONSUMER.MSG.NEXT"},  # and acks (replies to what it took)
    "draft": set(),
    "kv-store": set(),
    "prefill-queue": {"INFO", "STREAM.INFO", "CONSUMER.INFO"},  # watches; admin makes
    "admin": {"INFO", "DIRECT.GET", *OPERATOR},
}


# every role but the keeper (which makes the stream) and the operator
WORKER_ROLES = tuple(r for r in ROLES if r not in ("prefill-queue", "admin"))
assert {"prefill", "router", "kv-registry", "decode", "draft", "kv-store"} <= set(WORKER_ROLES)


creds, server = mesh_server_fixtures(subjects)


def _removes(verb: str) -> bool:
    """Whether the verb removes a stream, a consumer or their messages wholesale."""
    return verb.split(".")[-1] in ("DELETE", "PURGE", "RESTORE") and "MSG" not in verb


async def _reached(url: str, creds: MeshCredentials, role: str) -> set[str]:
    """The verbs whose request got an answer (any: an API error is an answer) as ``role``;
    the server refuses the others (a permissions violation, no answer)."""
    auth = creds.auth(role)
    refused: set[str] = set()

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()  # nats-py lowercases the server's -ERR line
        if "permissions violation" in text:
            refused.update(v for v, subject in VERBS.items() if f'"{subject.lower()}"' in text)

    nc = await nats.connect(url, error_cb=on_error, **auth.connect_options())
    try:
        answered: set[str] = set()
        inbox = f"{auth.inbox_prefix}.verbs"

        async def on_answer(msg) -> None:
            answered.add(msg.subject.rsplit(".", 1)[-1])

        await nc.subscribe(f"{inbox}.*", cb=on_answer)
        names = list(VERBS)
        # two rounds: a pull asked after the operator's delete was served gets no answer at
        # all (the consumer is gone), so the verbs that remove something go once the rest
        # are answered or refused
        for phase in (False, True):
            sent = [i for i, verb in enumerate(names) if _removes(verb) == phase]
            for i in sent:
                body = BODIES.get(names[i].removeprefix("other."), b"")
                await nc.publish(VERBS[names[i]], body, reply=f"{inbox}.{i}")
            await flush_to_server(nc)  # every refusal is said before this returns
            deadline = asyncio.get_running_loop().time() + 10.0
            while waiting := {
                names[i] for i in sent if str(i) not in answered and names[i] not in refused
            }:
                assert asyncio.get_running_loop().time() < deadline, (
                    f"{role}: neither answered nor refused: {waiting}"
                )
                await asyncio.sleep(0.02)
        return {names[int(i)] for i in answered}
    finally:
        await nc.close()


async def test_every_jetstream_verb_as_every_role_reaches_the_api_only_where_allowed(server, creds):
    assert set(ALLOWED) == set(ROLES)
    found = {}
    async with connect_nats(server.url, "setup", auth=creds.auth("admin")) as admin:
        for role in sorted(ROLES, key=lambda r: r == "admin"):  # admin may delete: last
            await ensure_queue(admin, subjects)  # what the verbs of the one before removed
            found[role] = await _reached(server.url, creds, role)
    assert found == ALLOWED


async def test_a_worker_cannot_give_the_queue_a_republish_rule(server, creds):
    """The escape of issue 27: as prefill (or any other worker or router role, or the keeper),
    update the stream so that the server republishes each job on ``admin.drain``. Refused for
    every role but the operator; the stream is as admin made it, and a job published after goes
    nowhere else."""
    rule = stream_config(subjects).as_dict()
    rule["republish"] = {"src": subjects.PREFILL_JOBS, "dest": subjects.ADMIN_DRAIN}
    async with (
        connect_nats(server.url, "keeper", auth=creds.auth("prefill-queue")) as keeper,
        connect_nats(server.url, "admin", auth=creds.auth("admin")) as admin,
    ):
        await ensure_queue(admin, subjects)
        logged_before = len(server.permission_violations())
        for role in (*WORKER_ROLES, "prefill-queue"):
            async with connect_nats(server.url, role, auth=creds.auth(role)) as nc:
                with pytest.raises(nats.errors.TimeoutError):
                    await nc.request(f"$JS.API.STREAM.UPDATE.{S}", orjson.dumps(rule), timeout=0.5)
        info = await keeper.jetstream().stream_info(S)
        assert info.config.republish is None
        drains = await admin.subscribe(subjects.ADMIN_DRAIN)
        await flush_to_server(admin)
        async with connect_nats(server.url, "router", auth=creds.auth("router")) as router:
            await publish_job(router, subjects, b'{"worker": "decode-0"}')
        with pytest.raises(nats.errors.TimeoutError):
            await drains.next_msg(timeout=0.5)
    violations = server.permission_violations()[logged_before:]
    for role in (
        *WORKER_ROLES,
        "prefill-queue",
    ):  # each attempt was refused by the server, and logged as its user's
        assert any(
            f'user:{role}"' in line and f"STREAM.UPDATE.{S}" in line for line in violations
        ), (
            role,
            violations,
        )


def _capture(keeper_inbox: str) -> dict:
    """Issue 40's stream config: the job subject plus another tenant's tokens and decode's
    adverts, each republished to the keeper's own inbox."""
    config = stream_config(subjects).as_dict()
    config["subjects"] = [
        subjects.PREFILL_JOBS,
        f"{subjects.prefix}.request.*.tokens",
        subjects.REGISTRY_ADVERTISE,
    ]
    config["republish"] = {"src": ">", "dest": f"{keeper_inbox}.>"}
    return config


async def test_the_keeper_cannot_capture_tokens_or_adverts_into_its_inbox(server, creds):
    """Issue 40, replayed: as the keeper, update the stream (and create it, as after a lost
    store) with ``request.*.tokens`` and ``registry.advertise`` republished to its own inbox.
    Both are refused by the server and logged as the keeper's; the stream keeps its one
    subject, and a token event and an advert published after reach the keeper's inbox not
    at all."""
    auth = creds.auth("prefill-queue")
    capture = orjson.dumps(_capture(auth.inbox_prefix))
    async with (
        connect_nats(server.url, "admin", auth=creds.auth("admin")) as admin,
        connect_nats(server.url, "keeper", auth=auth) as keeper,
        connect_nats(server.url, "decode", auth=creds.auth("decode")) as decode,
    ):
        await ensure_queue(admin, subjects)
        captured = await keeper.subscribe(f"{auth.inbox_prefix}.>")
        await flush_to_server(keeper)
        logged_before = len(server.permission_violations())
        for verb in ("UPDATE", "CREATE"):
            with pytest.raises(nats.errors.TimeoutError):
                await keeper.request(f"$JS.API.STREAM.{verb}.{S}", capture, timeout=0.5)
        info = await admin.jetstream().stream_info(S)
        assert info.config.subjects == [subjects.PREFILL_JOBS]
        assert info.config.republish is None
        await decode.publish(f"{subjects.prefix}.request.7.tokens", b'{"secret": "tokens"}')
        await decode.publish(subjects.REGISTRY_ADVERTISE, b'{"secret": "lane"}')
        await flush_to_server(decode)
        with pytest.raises(nats.errors.TimeoutError):
            await captured.next_msg(timeout=0.5)
    violations = server.permission_violations()[logged_before:]
    for verb in ("UPDATE", "CREATE"):
        assert any(
            'user:prefill-queue"' in line and f"STREAM.{verb}.{S}" in line for line in violations
        ), (verb, violations)


async def test_a_create_with_another_config_is_refused_when_the_stream_exists(server, creds):
    """What nats-server itself enforces (v2.10+): a CREATE is idempotent only for the same
    config; with other subjects it is refused (10058), whoever asks, so even the operator's
    CREATE cannot change a stream: only an UPDATE can, which no runtime role holds."""
    async with connect_nats(server.url, "admin", auth=creds.auth("admin")) as admin:
        await ensure_queue(admin, subjects)
        capture = orjson.dumps(_capture("_INBOX_admin"))
        reply = orjson.loads(
            (await admin.request(f"$JS.API.STREAM.CREATE.{S}", capture, timeout=2.0)).data
        )
        assert reply["error"]["err_code"] == 10058, reply
        assert (await admin.jetstream().stream_info(S)).config.subjects == [subjects.PREFILL_JOBS]


async def test_a_pull_delivers_to_the_reply_subject_it_names_not_yet_refused(server, creds):
    """docs/security.md, "Not yet": nats-server checks no permission on a pull's reply subject,
    so as prefill a ``MSG.NEXT`` with ``reply=admin.drain`` has the server deliver the job
    there. This pins the known gap: when a server starts refusing it, this fails and the docs
    say so."""
    async with (
        connect_nats(server.url, "admin", auth=creds.auth("admin")) as admin,
        connect_nats(server.url, "router", auth=creds.auth("router")) as router,
        connect_nats(server.url, "prefill", auth=creds.auth("prefill")) as prefill,
    ):
        await ensure_queue(admin, subjects)
        await admin.jetstream().purge_stream(S)  # the module's server: jobs of tests before
        drains = await admin.subscribe(subjects.ADMIN_DRAIN)
        await flush_to_server(admin)
        await publish_job(router, subjects, b'{"job": "pulled elsewhere"}')
        next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{S}.{DURABLE}"
        await prefill.publish(next_subject, BODIES["CONSUMER.MSG.NEXT"], reply=subjects.ADMIN_DRAIN)
        await flush_to_server(prefill)
        delivered = await drains.next_msg(timeout=2.0)
        assert delivered.data == b'{"job": "pulled elsewhere"}'
