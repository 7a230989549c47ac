"""shared/bus/message_guard.py against a real nats-server: what it refuses, what it answers, that a
handler's failure stays inside, and that every refusal is counted."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.micro
import pytest
from kvmesh.shared.bus.message_guard import MessageGuard, guard_of, is_inbox
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.token_streams import Abort
from kvmesh.shared.bus.nats_connect import flush_to_server
from kvmesh.shared.bus.nats_subscribe import subscriptions
from kvmesh.shared.obs.metric_set import MetricSet


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.01)


def _recorder(answer: bytes):
    """A handler that records each message's data and answers ``answer``, and its record."""
    seen: list[bytes] = []

    async def handle(msg) -> None:
        seen.append(msg.data)
        await msg.respond(answer)

    return handle, seen


async def _service(nc, subject: str, handler) -> nats.micro.Service:
    """A micro service whose one endpoint on ``subject`` is ``handler``, known to the server."""
    svc = await nats.micro.add_service(nc, name="guard-test", version="0.0.1")
    await svc.add_endpoint(name="e", subject=subject, handler=handler)
    await flush_to_server(nc)
    return svc


@pytest.mark.parametrize(
    ("reply", "counter"), [("", "no_reply"), ("kvmesh.m.registry.advertise", "bad_reply")]
)
async def test_a_request_with_no_inbox_to_answer_never_reaches_its_handler(
    nats_client, reply, counter
):
    """No reply subject (nats-py's respond() would raise ValueError), or one that is no inbox
    (issue 40: a reply goes out under ``allow_responses`` on whatever subject the request named,
    so a put with ``reply=registry.advertise`` made the store publish there). Refused and
    counted; nothing is published on that subject, and a request from an inbox is served."""
    nc = nats_client
    guard = guard_of(nc)
    handle, seen = _recorder(b"ok")
    svc = await _service(nc, "guard.e", guard.request(handle))
    hijacked = await nc.subscribe(reply) if reply else None
    await flush_to_server(nc)
    await nc.publish("guard.e", b"refused", reply=reply)
    assert (await nc.request("guard.e", b"asked", timeout=5)).data == b"ok"
    assert seen == [b"asked"]
    assert guard.counts[counter] == 1
    if hijacked is not None:
        with pytest.raises(nats.errors.TimeoutError):
            await hijacked.next_msg(timeout=0.3)
    await svc.stop()


async def test_a_failing_handler_answers_500_and_the_endpoint_goes_on(nats_client):
    nc = nats_client
    guard = guard_of(nc)
    calls = []

    async def handle(req) -> None:
        calls.append(req.data)
        if req.data == b"boom":
            raise RuntimeError("a bug a message found")
        await req.respond(b"fine")

    svc = await _service(nc, "guard.f", guard.request(handle))
    reply = await nc.request("guard.f", b"boom", timeout=5)
    assert reply.headers["Nats-Service-Error-Code"] == "500"
    assert "RuntimeError" not in reply.headers["Nats-Service-Error"]  # no internals leak
    assert (await nc.request("guard.f", b"next", timeout=5)).data == b"fine"
    assert guard.counts["failed"] == 1
    await svc.stop()


async def test_a_malformed_or_oversized_message_is_refused_and_the_next_is_handled(nats_client):
    nc = nats_client
    guard = guard_of(nc)
    guard.max_bytes = 256
    got: list[Abort] = []

    async def on_abort(msg: Abort) -> None:
        got.append(msg)

    async with subscriptions(nc, ("guard.abort", Abort, on_abort)):
        await flush_to_server(nc)
        await nc.publish("guard.abort", b'{"request_id": 7}')  # wrong field type
        await nc.publish("guard.abort", b"x" * 257)
        await nc.publish("guard.abort", encode_message(Abort("r1")))
        await _until(lambda: got)
    assert [m.request_id for m in got] == ["r1"]
    assert guard.counts["malformed"] == 1 and guard.counts["oversized"] == 1


async def test_what_a_spawned_task_raises_does_not_fail_its_group():
    guard = MessageGuard()

    async def fails() -> None:
        raise ValueError("no reply subject set")

    async with asyncio.TaskGroup() as tg:
        guard.spawn(tg, fails(), "kvmesh.m.decode.d0.reserve")
    assert guard.counts["failed"] == 1


async def test_a_handler_error_on_a_plain_subscription_is_contained(nats_client):
    nc = nats_client
    guard = guard_of(nc)
    handle, handled = _recorder(b"answer")  # its respond() raises without a reply subject
    await nc.subscribe("guard.raw", cb=guard.raw(handle, needs_reply=True))
    await flush_to_server(nc)
    await nc.publish("guard.raw", b"unanswerable")
    assert (await nc.request("guard.raw", b"q", timeout=5)).data == b"answer"
    assert handled == [b"q"] and guard.counts["no_reply"] == 1


def test_refusals_before_the_counter_is_bound_are_counted_too():
    guard = MessageGuard()
    guard.refuse("malformed", "s", "bad")
    metrics = MetricSet("kvmesh_test")
    guard.count_into(metrics.nats_refused)
    guard.refuse("malformed", "s", "bad")
    guard.refuse("no_reply", "s", "none")
    sample = metrics.registry.get_sample_value
    assert sample("kvmesh_test_nats_refused_total", {"reason": "malformed"}) == 2
    assert sample("kvmesh_test_nats_refused_total", {"reason": "no_reply"}) == 1
    with pytest.raises(AssertionError):
        guard.refuse("whatever", "s", "unknown reason")


async def test_a_request_the_client_gave_up_on_is_not_an_error(nats_client):
    """An answer to a requester that left is published into the void: no exception."""
    nc = nats_client
    guard = guard_of(nc)

    async def slow(req) -> None:
        await asyncio.sleep(0.3)
        await req.respond(b"late")

    svc = await _service(nc, "guard.slow", guard.request(slow))
    with pytest.raises(nats.errors.TimeoutError):
        await nc.request("guard.slow", b"q", timeout=0.05)
    await asyncio.sleep(0.5)
    assert guard.counts["failed"] == 0
    await svc.stop()


async def test_a_plain_request_whose_reply_is_no_inbox_is_refused(nats_client):
    nc = nats_client
    guard = guard_of(nc)
    handle, handled = _recorder(b"answer")
    await nc.subscribe("guard.raw2", cb=guard.raw(handle, needs_reply=True))
    await flush_to_server(nc)
    await nc.publish("guard.raw2", b"forged", reply="$JS.API.STREAM.DELETE.X")
    assert (await nc.request("guard.raw2", b"q", timeout=5)).data == b"answer"
    assert handled == [b"q"] and guard.counts["bad_reply"] == 1


@pytest.mark.parametrize(
    ("reply", "inbox"),
    [
        ("_INBOX.abc.1", True),  # nats-py's default: a mesh without credentials
        ("_INBOX_router.abc.1", True),  # a role's own inbox (shared/bus/nats_auth.py)
        ("_INBOX_prefill-queue.x", True),
        ("_INBOX", False),
        ("_INBOX.", False),
        ("_INBOX_nobody.abc", False),  # not a role of the mesh
        ("kvmesh.m.registry.advertise", False),
        ("admin.x", False),
        ("kvmesh.m.admin.drain", False),
        ("$JS.API.STREAM.DELETE.X", False),
        ("$SRV.PING", False),
    ],
)
def test_only_an_inbox_is_a_reply_subject(reply: str, inbox: bool) -> None:
    assert is_inbox(reply) is inbox
