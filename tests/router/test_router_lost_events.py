"""Events the router never gets (NATS lost them across a reconnect): a gap in a stream's token
counts migrates the stream, silence after a reconnect runs the request again, and with no retry
left the stream ends with a clear error. Real nats-server, the fake mesh peer."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import orjson
from kvmesh.services.router.attempts import is_gap
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.service import serve_router
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from support.router_fake_mesh import REPLY_TEXT, FakeMesh

MODEL = "kvmesh-tiny"


@contextlib.asynccontextmanager
async def router_on(nats_url: str, mesh: FakeMesh, **config):
    config = RouterConfig(nats_url=nats_url, host="127.0.0.1", port=0, **config)
    async with (
        mesh.running(),
        serve_router(config) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield http


def _stream_text(raw: bytes) -> tuple[str, list[dict]]:
    """The streamed text, and the error events, of a completion stream ending in [DONE]."""
    events = [e.split(b"data: ", 1)[1] for e in raw.strip().split(b"\n\n")]  # after its id
    assert events[-1] == b"[DONE]", raw[-200:]
    chunks = [orjson.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    text = "".join(c["choices"][0]["text"] for c in chunks if "choices" in c)
    return text, errors


def test_a_gap_is_a_count_that_does_not_follow_from_the_tokens_received():
    event = lambda n, ids=(7,), reason=None: TokenEvent("r", ids, reason, 1, n)
    assert not is_gap(event(3), 2)
    assert is_gap(event(4), 2)  # the third token's event went missing
    assert not is_gap(event(3, ids=(7, 8)), 1)  # two tokens in one event
    assert not is_gap(event(2, ids=(), reason="stop"), 2)  # a finish without tokens
    assert not is_gap(event(0), 5)  # not counted
    assert not is_gap(event(9, ids=(), reason="error"), 1)


async def test_a_lost_token_event_migrates_the_stream_without_a_gap(nats_server):
    mesh = FakeMesh(nats_server, continue_reply=True, lose_token=3, token_delay_s=0.01)
    async with router_on(nats_server, mesh) as http:
        resp = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True},
        )
        text, errors = _stream_text(await resp.read())
    assert errors == [] and text == REPLY_TEXT[:10]
    first, again = mesh.places
    assert again.request_id == f"{first.request_id}-m1"
    assert again.prompt_ids == first.prompt_ids + tuple(REPLY_TEXT[:2].encode())
    assert again.sampling.max_tokens == 8
    assert [a.request_id for a in mesh.aborts] == [first.request_id]
    assert "token events were lost" in mesh.aborts[0].reason


async def test_a_lost_token_event_with_no_retry_left_ends_the_stream_with_an_error(nats_server):
    mesh = FakeMesh(nats_server, lose_token=3, token_delay_s=0.01)
    async with router_on(nats_server, mesh, max_retries=0) as http:
        resp = await http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 10, "stream": True},
        )
        started = time.monotonic()
        text, errors = _stream_text(await resp.read())
    assert text == REPLY_TEXT[:2]
    assert len(errors) == 1 and "token events were lost" in errors[0]["message"]
    assert time.monotonic() - started < 5  # not the 30 s token timeout
    assert [a.request_id for a in mesh.aborts] == [mesh.places[0].request_id]


async def test_a_broken_stream_with_a_structured_output_ends_with_an_error_not_a_migration(
    nats_server,
):
    """A migrated attempt takes the output so far as prompt; the grammar would start over
    after it (a second JSON object inside the first), so the stream ends and says why."""
    mesh = FakeMesh(nats_server, continue_reply=True, lose_token=3, token_delay_s=0.01)
    async with router_on(nats_server, mesh) as http:
        resp = await http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 10,
                "stream": True,
                "guided_regex": "[A-Za-z .]+",
            },
        )
        text, errors = _stream_text(await resp.read())
    assert text == REPLY_TEXT[:2]
    assert len(errors) == 1, errors
    assert "structured output" in errors[0]["message"] and "send it again" in errors[0]["message"]
    assert len(mesh.places) == 1  # not placed again


async def test_silence_after_a_nats_restart_runs_the_request_again(nats_server_process):
    server = nats_server_process
    # the first placement's tokens are "lost in the restart": they never come
    mesh = FakeMesh(server.url, hold_first=True)
    async with router_on(server.url, mesh) as http:
        request = asyncio.create_task(
            http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
        )
        while not mesh.places:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(server.stop)
        await asyncio.to_thread(server.start)  # the same port, an empty server
        restarted = time.monotonic()
        resp = await asyncio.wait_for(request, 30)
        body = await resp.json()
        took = time.monotonic() - restarted
    assert resp.status == 200 and body["choices"][0]["text"] == REPLY_TEXT[:5]
    assert took < 10  # a reconnect and a second of silence, not the 300 s first-token timeout
    first, again = mesh.places
    assert again.request_id == f"{first.request_id}-r1"
    assert [a.request_id for a in mesh.aborts] == [first.request_id]
    assert "NATS reconnected" in mesh.aborts[0].reason


async def test_a_placement_the_registry_never_answers_is_asked_again_under_a_new_id(nats_server):
    # the registry died holding the first placement: no reply ever comes
    mesh = FakeMesh(nats_server, unanswered_places=1)
    async with router_on(nats_server, mesh, place_timeout_s=0.5) as http:
        started = time.monotonic()
        resp = await http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5}
        )
        body = await resp.json()
        took = time.monotonic() - started
        await mesh.wait_for_abort()
    assert resp.status == 200 and body["choices"][0]["text"] == REPLY_TEXT[:5]
    assert took < 5  # one place timeout, then the next registry
    first, again = mesh.places
    assert again.request_id == f"{first.request_id}-r1"
    # the lost placement may have reserved blocks: its wire id is aborted
    assert [(a.request_id, a.reason) for a in mesh.aborts] == [(first.request_id, "placement lost")]


async def test_a_request_sent_while_nats_is_down_waits_and_is_served_once_it_is_back(
    nats_server_process,
):
    server = nats_server_process
    mesh = FakeMesh(server.url)
    async with router_on(server.url, mesh, place_timeout_s=1.0) as http:
        await asyncio.to_thread(server.stop)
        request = asyncio.create_task(
            http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
        )
        await asyncio.sleep(3.5)  # longer than the worker liveness (3 s) and the place timeout
        assert not request.done()
        await asyncio.to_thread(server.start)  # the same port
        resp = await asyncio.wait_for(request, 30)
        body = await resp.json()
    assert resp.status == 200, body
    assert body["choices"][0]["text"] == REPLY_TEXT[:5]
    # nothing was sent into the outage: the one placement came after the reconnect
    assert len(mesh.places) == 1 and mesh.aborts == []
