"""The router over HTTP against a real nats-server and a fake mesh peer (tests/support/router_fake_mesh.py):
wire framing of SSE, placement and prefill jobs, aborts on disconnect, overload and error shapes."""

from __future__ import annotations

import asyncio
import contextlib
import re

import aiohttp
import jsonschema
import msgspec
import orjson
import pytest
from kvmesh.services.router import response_bodies
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.openapi import openapi_document
from kvmesh.services.router.service import serve_router
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.bus.nats_connect import flush_to_server
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.model.tiny import tiny_tokenizer
from support.router_fake_mesh import REPLY_TEXT, FakeMesh

MODEL = "kvmesh-tiny"
LONG_PROMPT = "x" * 80  # over the default local_prefill_threshold (64 tokens): remote prefill


@contextlib.asynccontextmanager
async def mesh_and_router(nats_url: str, mesh: FakeMesh | None = None, **config):
    config = RouterConfig(nats_url=nats_url, host="127.0.0.1", port=0, **config)
    mesh = mesh or FakeMesh(nats_url)
    mesh.nats_url = nats_url
    async with (
        mesh.running(),
        serve_router(config) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield mesh, running, http


def _complete(http: aiohttp.ClientSession, prompt: str | list[int], **fields):
    """POST /v1/completions of ``prompt`` to MODEL, with the request's other ``fields``."""
    return http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **fields})


def sse_payloads(raw: bytes) -> list[bytes]:
    """Split an SSE body into event payloads, checking the exact OpenAI framing."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    # a resumable stream's events carry an id line first (docs/faults.md)
    events = [re.sub(rb"^id: [^\n]+\n", b"", e) for e in raw[:-2].split(b"\n\n")]
    for event in events:
        assert event.startswith(b"data: "), event
        assert b"\n" not in event, event
    return [event[len(b"data: ") :] for event in events]


async def test_completion_places_publishes_prefill_job_and_returns_text(nats_server):
    async with mesh_and_router(nats_server) as (mesh, _, http):
        resp = await _complete(http, LONG_PROMPT, max_tokens=10)
        assert resp.status == 200, await resp.text()
        body = await resp.json()
        metrics = await (await http.get("/metrics")).text()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == REPLY_TEXT[:10]
    assert body["choices"][0]["finish_reason"] == "length"
    prompt_len = 1 + len(LONG_PROMPT)  # BOS + bytes
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 10,
        "total_tokens": prompt_len + 10,
    }
    (place,) = mesh.places
    assert not place.local_prefill and place.request_id == body["id"]
    assert len(place.prompt_ids) == prompt_len and place.sampling.max_tokens == 10
    (job,) = mesh.jobs
    assert (job.decode_worker_id, job.lease_id, job.rkey) == (
        "decode-fake",
        f"lease-{body['id']}",
        7,
    )
    assert job.block_addrs == (4096, 8192) and job.enqueued_at > 0
    assert mesh.aborts == []  # finished normally: nothing to abort
    assert "kvmesh_router_prefill_compute_seconds_count 1" in metrics
    assert "kvmesh_router_kv_exposed_transfer_seconds_count 1" in metrics
    assert "kvmesh_router_time_to_first_token_seconds_count 1" in metrics
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="200"} 1' in metrics


async def test_short_prompt_is_prefilled_locally_without_a_prefill_job(nats_server):
    async with mesh_and_router(nats_server) as (mesh, _, http):
        resp = await _complete(http, [1, 2, 3])
        body = await resp.json()
    assert resp.status == 200 and body["choices"][0]["text"] == REPLY_TEXT[:16]
    assert mesh.places[0].local_prefill and mesh.jobs == []


async def test_large_bodies_are_tokenized_in_a_worker_thread_and_small_ones_inline(
    nats_server, monkeypatch
):
    """The defect: a 60 MB body froze every stream for seconds while it was tokenized on the
    event loop. A large body's parse and tokenization now run in a worker thread."""
    import threading

    from kvmesh.services.router import generation
    from kvmesh.services.router.generation import INLINE_BODY_BYTES

    threads: list[str] = []

    def recording_tokenize(*args):
        threads.append(threading.current_thread().name)
        return tokenize(*args)

    tokenize = generation.tokenize
    monkeypatch.setattr(generation, "tokenize", recording_tokenize)
    padding = "x" * (INLINE_BODY_BYTES + 1)
    async with mesh_and_router(nats_server) as (_, _, http):
        small = await _complete(http, [1, 2])
        big = {"model": MODEL, "prompt": [1, 2, 3], "user": padding}
        large = await http.post("/v1/completions", json=big)
    main = threading.main_thread().name
    assert small.status == 200 and large.status == 200
    assert threads[0] == main and threads[1] != main, threads


async def test_large_bodies_are_prepared_off_the_event_loop_with_the_same_result(nats_server):
    from kvmesh.services.router.generation import INLINE_BODY_BYTES

    padding = "x" * (INLINE_BODY_BYTES + 1)  # an ignored field makes the body large
    too_long = "y" * (INLINE_BODY_BYTES + 1)  # more tokens than kvmesh-tiny's context
    async with mesh_and_router(nats_server) as (mesh, _, http):
        big = {"model": MODEL, "prompt": [1, 2, 3], "user": padding}
        resp = await http.post("/v1/completions", json=big)
        body = await resp.json()
        refused = await _complete(http, too_long)
        error = (await refused.json())["error"]
    assert resp.status == 200 and body["choices"][0]["text"] == REPLY_TEXT[:16]
    assert mesh.places[0].prompt_ids == (1, 2, 3)
    assert refused.status == 400 and error["code"] == "context_length_exceeded"


async def test_colocated_mode_prefills_every_prompt_locally(nats_server):
    async with mesh_and_router(nats_server, mode="colocated") as (mesh, _, http):
        resp = await _complete(http, LONG_PROMPT)
        assert resp.status == 200
    assert mesh.places[0].local_prefill and mesh.jobs == []


async def test_eos_finishes_with_stop_and_counts_the_eos_token(nats_server):
    async with mesh_and_router(nats_server) as (_, _, http):
        resp = await _complete(http, "hi", max_tokens=100)
        body = await resp.json()
    assert body["choices"][0] == {
        "index": 0,
        "text": REPLY_TEXT,
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert body["usage"]["completion_tokens"] == len(REPLY_TEXT) + 1


async def test_chat_stream_is_framed_like_openai_on_the_wire(nats_server):
    async with mesh_and_router(nats_server) as (_, _, http):
        resp = await http.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 12,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    payloads = sse_payloads(raw)
    assert payloads[-1] == b"[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert content == REPLY_TEXT[:12]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    prompt_len = len(tiny_tokenizer().encode_chat([{"role": "user", "content": "hello"}]))
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_len
    assert all(c["usage"] is None for c in chunks[:-1])


async def test_completion_stream_ends_with_finish_chunk_and_done(nats_server):
    async with mesh_and_router(nats_server) as (_, _, http):
        resp = await _complete(http, "hi", max_tokens=5, stream=True)
        payloads = sse_payloads(await resp.read())
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == b"[DONE]"
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY_TEXT[:5]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


async def test_stream_has_a_chunk_per_token_even_inside_a_multibyte_character(nats_server):
    mesh = FakeMesh(nats_server, reply_text="é€!")  # byte tokens: 2 + 3 + 1, then EOS
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        resp = await _complete(http, "hi", max_tokens=20, stream=True)
        payloads = sse_payloads(await resp.read())
    texts = [orjson.loads(p)["choices"][0]["text"] for p in payloads[:-1]]
    # one chunk per token as it is made (6 bytes + EOS), then the finish chunk
    assert texts[:7] == ["", "é", "", "", "€", "!", ""]
    assert "".join(texts) == "é€!"


async def test_stop_string_truncates_and_aborts_the_rest(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.005)
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        resp = await _complete(http, "hi", max_tokens=40, stop=["fox", "zzz"])
        body = await resp.json()
        abort = await mesh.wait_for_abort()
    assert body["choices"][0]["text"] == "The quick brown "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert abort.request_id == body["id"] and abort.reason == "stop string"


async def test_client_disconnect_mid_stream_publishes_abort(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.05, eos_at_end=False)
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        resp = await _complete(http, "hi", max_tokens=500, stream=True)
        assert resp.status == 200
        first = await resp.content.readuntil(b"\n\n")
        assert first.startswith(b"id: ") and b"\ndata: " in first
        resp.close()  # drop the connection mid-stream
        abort = await mesh.wait_for_abort()
    assert abort.request_id == mesh.places[0].request_id
    assert abort.reason == "client disconnected"


async def test_cancelled_non_stream_request_publishes_abort(nats_server):
    mesh = FakeMesh(nats_server, hold_tokens=True)
    async with mesh_and_router(nats_server, mesh) as (_, running, http):
        with pytest.raises(asyncio.TimeoutError):
            await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "hi"},
                timeout=aiohttp.ClientTimeout(total=0.5),
            )
        abort = await mesh.wait_for_abort()
        await asyncio.sleep(0.05)
        assert running.router.num_in_flight == 0
    assert abort.reason == "client disconnected"


async def test_overloaded_mesh_queues_the_request_until_there_is_room(nats_server):
    mesh = FakeMesh(nats_server, retry_after_s=0.1, overloaded_places=3)
    async with mesh_and_router(nats_server, mesh) as (_, running, http):
        resp = await _complete(http, "x")
        body = await resp.json()
        metrics = running.router.metrics
    assert resp.status == 200, body
    assert len(mesh.places) == 4  # three "at capacity" answers, then placed
    assert body["choices"][0]["text"]
    assert metrics.sample("kvmesh_router_requests_waiting") == 0


async def test_request_that_never_finds_room_is_504_after_its_timeout(nats_server):
    mesh = FakeMesh(nats_server, retry_after_s=0.1)
    async with mesh_and_router(nats_server, mesh, first_token_timeout_s=1.0) as (_, _, http):
        resp = await _complete(http, "x")
        body = await resp.json()
    assert resp.status == 504 and "no room" in body["error"]["message"]
    assert len(mesh.places) >= 2 and mesh.aborts == []  # nothing was reserved


async def test_router_renews_the_lease_until_the_first_token(nats_server):
    mesh = FakeMesh(nats_server, hold_tokens=True)
    prompt = "y" * 200  # above the local-prefill threshold: remote prefill under a lease
    async with mesh_and_router(nats_server, mesh, lease_ms=150) as (_, _, http):
        with pytest.raises(asyncio.TimeoutError):
            await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": prompt},
                timeout=aiohttp.ClientTimeout(total=0.6),
            )
        renewals = list(mesh.renewals)
        await mesh.wait_for_abort()
        await asyncio.sleep(0.2)
    assert len(renewals) >= 3
    assert {(r.lease_id, r.lease_ms) for r in renewals} == {(mesh.jobs[0].lease_id, 150)}
    assert len(mesh.renewals) <= len(renewals) + 1  # stopped once the request was aborted


async def test_refused_placement_is_503(nats_server):
    mesh = FakeMesh(nats_server, refuse_error="no decode workers")
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        resp = await _complete(http, "x")
        body = await resp.json()
    assert resp.status == 503 and "no decode workers" in body["error"]["message"]


async def test_no_registry_is_503_naming_the_subject(nats_server):
    config = RouterConfig(nats_url=nats_server, host="127.0.0.1", port=0)
    async with serve_router(config) as running, aiohttp.ClientSession(running.url) as http:
        resp = await _complete(http, "x")
        body = await resp.json()
    assert resp.status == 503
    assert "kvmesh.kvmesh-tiny.registry.place" in body["error"]["message"]


async def test_first_token_timeout_is_504_and_aborts(nats_server):
    mesh = FakeMesh(nats_server, hold_tokens=True)
    async with mesh_and_router(nats_server, mesh, first_token_timeout_s=0.3) as (_, _, http):
        resp = await _complete(http, "x")
        body = await resp.json()
        abort = await mesh.wait_for_abort()
    assert resp.status == 504 and body["error"]["code"] == "timeout"
    assert abort.reason == "timeout"


async def test_mesh_error_is_502_before_streaming_and_an_error_event_after(nats_server):
    mesh = FakeMesh(nats_server, fail_with="decode worker lost its KV")
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        resp = await _complete(http, "x")
        body = await resp.json()
        assert resp.status == 502 and "lost its KV" in body["error"]["message"]
        resp = await _complete(http, "x", stream=True)
        payloads = sse_payloads(await resp.read())
        metrics = await (await http.get("/metrics")).text()
    assert resp.status == 200
    assert 'kvmesh_router_requests_total{endpoint="/v1/completions",status="502"} 2' in metrics
    assert payloads[-1] == b"[DONE]"
    error = orjson.loads(payloads[-2])["error"]
    assert error["code"] == "mesh_error" and "lost its KV" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{oops", 400, None),
        ("/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "n": 17}', 400, "n"),
        ("/v1/completions", b'{"model": "kvmesh-tiny", "prompt": "x", "tools": 1}', 400, "tools"),
        ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', 404, "model"),
        ("/v1/chat/completions", b'{"model": "kvmesh-tiny", "messages": []}', 400, "messages"),
        (
            "/v1/completions",
            b'{"model": "kvmesh-tiny", "prompt": "x", "max_tokens": 100000}',
            400,
            "max_tokens",
        ),
    ],
)
async def test_bad_input_gets_openai_error_shape(nats_server, path, body, status, param):
    async with mesh_and_router(nats_server) as (mesh, _, http):
        resp = await http.post(path, data=body, headers={"Content-Type": "application/json"})
        payload = await resp.json()
        metrics = await (await http.get("/metrics")).text()
    assert resp.status == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["param"] == param
    assert mesh.places == []  # refused before touching the mesh
    assert f'endpoint="{path}",status="{status}"' in metrics


async def test_requests_beyond_the_admission_limit_are_429_with_retry_after(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.02)
    async with mesh_and_router(nats_server, mesh, max_concurrent_requests=1) as (_, _, http):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 10}
        first = asyncio.create_task(http.post("/v1/completions", json=body))
        await asyncio.sleep(0.1)
        second = await http.post("/v1/completions", json=body)
        assert second.status == 429 and second.headers["Retry-After"] == "1"
        assert (await second.json())["error"]["code"] == "rate_limit_exceeded"
        assert (await first).status == 200


async def test_models_health_openapi_and_unknown_route(nats_server):
    async with mesh_and_router(nats_server, served_model_name="tiny") as (_, _, http):
        models_raw = await (await http.get("/v1/models")).read()
        card_raw = await (await http.get("/v1/models/tiny")).read()
        for _ in range(50):  # ready once the fake decode worker's first heartbeat is heard
            health = await http.get("/health")
            if health.status == 200:
                break
            await asyncio.sleep(0.05)
        doc = await (await http.get("/openapi.json")).json()
        missing = await http.get("/v1/nope")
        missing_body = await missing.json()
        wrong_method = await http.get("/v1/completions")
        metrics = await http.get("/metrics")
        one = await http.get("/v1/models/other")
    # the answers are what the published schema says (every field there, of its type)
    models = msgspec.json.decode(models_raw, type=response_bodies.ModelList, strict=True)
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len > 0
    assert msgspec.json.decode(card_raw, type=response_bodies.Model) == models.data[0]
    assert health.status == 200 and (await health.json())["status"] == "ok"
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"]
    assert missing.status == 404 and missing_body["error"]["code"] == "unknown_url"
    assert wrong_method.status == 405
    assert metrics.headers["Content-Type"].startswith("text/plain; version=")
    assert one.status == 404


async def _announce_gone(nats_url: str, worker_id: str, role: str = "decode") -> None:
    from kvmesh.shared.bus.nats_connect import connect_nats

    async with connect_nats(nats_url, "registry-stand-in") as nc:
        gone = WorkerGone(worker_id, role, last_seen_s=3.0)
        await nc.publish(Subjects(DEFAULT_MESH).REGISTRY_WORKER_GONE, encode_message(gone))
        await flush_to_server(nc)


async def test_decode_death_before_the_first_token_runs_the_request_again(nats_server):
    mesh = FakeMesh(nats_server, hold_first=True)
    async with mesh_and_router(nats_server, mesh) as (_, running, http):
        task = asyncio.create_task(_complete(http, "x", max_tokens=8))
        while not mesh.places:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await _announce_gone(nats_server, "decode-fake")
        resp = await asyncio.wait_for(task, 10)
        body = await resp.json()
        retries = running.router.metrics.sample
    assert resp.status == 200 and body["choices"][0]["text"] == REPLY_TEXT[:8]
    first, second = mesh.places
    assert second.request_id == f"{first.request_id}-r1" and body["id"] == first.request_id
    assert [a.request_id for a in mesh.aborts] == [first.request_id]  # the old attempt let go
    assert retries("kvmesh_router_retries_total", role="decode") == 1


async def test_decode_death_mid_stream_migrates_the_stream_without_a_gap(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.1, continue_reply=True)
    async with mesh_and_router(nats_server, mesh) as (_, running, http):
        resp = await _complete(http, "x", max_tokens=30, stream=True)
        first = await resp.content.readuntil(b"\n\n")  # the first token is out
        await _announce_gone(nats_server, "decode-fake")
        rest = await asyncio.wait_for(resp.content.read(), 10.0)
        retries = running.router.metrics.sample
    payloads = [e.split(b"data: ", 1)[1] for e in (first + rest).split(b"\n\n") if e]  # after ids
    chunks = [orjson.loads(p) for p in payloads if p.startswith(b"{")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == REPLY_TEXT[:30] and rest.endswith(b"data: [DONE]\n\n")  # no gap, no repeat
    original, migrated = mesh.places
    assert migrated.request_id == f"{original.request_id}-m1"
    sent = len(migrated.prompt_ids) - len(original.prompt_ids)
    assert migrated.prompt_ids == original.prompt_ids + tuple(REPLY_TEXT[:sent].encode())
    assert migrated.sampling.max_tokens == 30 - sent
    assert [a.request_id for a in mesh.aborts] == [original.request_id]
    assert retries("kvmesh_router_retries_total", role="decode-migrate") == 1


async def test_decode_death_mid_stream_with_no_retries_left_ends_the_stream_at_once(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.3)
    async with mesh_and_router(nats_server, mesh, max_retries=0) as (_, _, http):
        resp = await _complete(http, "x", max_tokens=40, stream=True)
        await resp.content.readuntil(b"\n\n")  # the first token is out
        await _announce_gone(nats_server, "decode-fake")
        rest = await asyncio.wait_for(resp.content.read(), 2.0)  # not the 30 s token timeout
    assert b"decode worker decode-fake died" in rest and rest.endswith(b"data: [DONE]\n\n")


async def test_death_of_an_unrelated_worker_changes_nothing(nats_server):
    mesh = FakeMesh(nats_server, token_delay_s=0.02)
    async with mesh_and_router(nats_server, mesh) as (_, _, http):
        task = asyncio.create_task(_complete(http, "x", max_tokens=8))
        await asyncio.sleep(0.05)
        await _announce_gone(nats_server, "decode-other")
        resp = await asyncio.wait_for(task, 10)
    assert resp.status == 200 and len(mesh.places) == 1


async def test_with_no_prefill_worker_alive_long_prompts_are_prefilled_on_decode(nats_server):
    mesh = FakeMesh(nats_server, prefill_alive=False)
    async with mesh_and_router(nats_server, mesh, worker_liveness_s=0.3) as (_, _, http):
        await asyncio.sleep(0.4)  # listened one liveness window: nobody
        resp = await _complete(http, LONG_PROMPT)
    assert resp.status == 200
    [place] = mesh.places
    assert place.local_prefill and mesh.jobs == []


async def test_long_prompts_go_to_the_prefill_pool_while_it_heartbeats(nats_server):
    mesh = FakeMesh(nats_server)
    async with mesh_and_router(nats_server, mesh, worker_liveness_s=0.3) as (_, _, http):
        await asyncio.sleep(0.4)
        resp = await _complete(http, LONG_PROMPT)
    assert resp.status == 200
    [place] = mesh.places
    assert not place.local_prefill and len(mesh.jobs) == 1


async def test_queued_jobs_move_to_local_prefill_when_the_last_prefill_worker_dies(nats_server):
    mesh = FakeMesh(nats_server, hold_first=True)
    config = {"worker_liveness_s": 0.3}
    async with mesh_and_router(nats_server, mesh, **config) as (_, _, http):
        await asyncio.sleep(0.4)
        task = asyncio.create_task(_complete(http, LONG_PROMPT))
        while not mesh.jobs:
            await asyncio.sleep(0.01)
        mesh.prefill_alive = False  # it stops beating, then the registry drops it
        await asyncio.sleep(0.4)
        await _announce_gone(nats_server, "prefill-fake", role="prefill")
        resp = await asyncio.wait_for(task, 10)
    assert resp.status == 200
    first, second = mesh.places
    assert not first.local_prefill and second.local_prefill


async def test_health_is_ready_only_while_a_decode_worker_heartbeats(nats_server):
    mesh = FakeMesh(nats_server, decode_alive=False)
    async with mesh_and_router(nats_server, mesh, worker_liveness_s=0.3) as (_, _, http):
        down = await http.get("/health")
        down_body = await down.json()
        mesh.decode_alive = True
        await asyncio.sleep(0.3)
        up = await http.get("/health")
        up_body = await up.json()
    assert down.status == 503 and down.headers["Retry-After"] == "1"
    assert "no decode worker" in down_body["reason"] and down_body["decode_workers"] == 0
    assert up.status == 200 and up_body["decode_workers"] == 1 and up_body["prefill_workers"] == 1
    documented = openapi_document("m")["paths"]["/health"]["get"]["responses"]
    for status, body in ((503, down_body), (200, up_body)):  # as /openapi.json says
        schema = documented[str(status)]["content"]["application/json"]["schema"]
        jsonschema.validate(body, schema)


async def test_no_decode_worker_at_all_is_503_not_a_wait_in_the_queue(nats_server):
    mesh = FakeMesh(nats_server, decode_alive=False, retry_after_s=0.5)
    async with mesh_and_router(nats_server, mesh, worker_liveness_s=0.3) as (_, _, http):
        await asyncio.sleep(0.4)  # listened one window: no decode worker
        resp = await asyncio.wait_for(_complete(http, "x"), 5)
        body = await resp.json()
    assert resp.status == 503 and "no decode worker is alive" in body["error"]["message"]
    assert "Retry-After" in resp.headers
