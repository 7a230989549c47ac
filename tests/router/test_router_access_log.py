"""The router's logs say what a user needs at info (issue 45): one access line per request
(method, route, status, tokens, time to first token, duration), and one ``max_model_len``, the
value /v1/models reports, logged once the decode workers' pools are heard."""

from __future__ import annotations

import asyncio

from kvmesh.services.router.pool_capacity import PoolCapacity
from kvmesh.shared.bus.messages.codec import encode_message
from kvmesh.shared.bus.nats_connect import connect_nats, flush_to_server
from kvmesh.shared.config.subjects import DEFAULT_MESH, Subjects
from kvmesh.shared.model.identity import model_spec
from kvmesh.shared.model.tiny import tiny_config
from support.adverts import idle_advert, with_fields
from support.log_capture import captured
from test_router_service import LONG_PROMPT, MODEL, mesh_and_router


async def test_each_request_leaves_one_access_line_at_info(nats_server):
    with captured("kvmesh.services.router.access_log", level="debug") as log:
        async with mesh_and_router(nats_server) as (_, _, http):
            body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5}
            done = await (await http.post("/v1/completions", json=body)).json()
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            streamed = await http.post(
                "/v1/chat/completions", json={**chat, "max_tokens": 3, "stream": True}
            )
            await streamed.read()
            bad = await http.post("/v1/completions", json={"model": MODEL})
            card = await http.get(f"/v1/models/{MODEL}")
            await http.get("/metrics")
    lines = [e for e in log.events if e["event"] == "request"]
    by_route = {(e["method"], e["route"], e["status"]): e for e in lines}
    assert len(lines) == len(by_route) == 5, lines  # one each
    complete = by_route["POST", "/v1/completions", 200]
    assert complete["level"] == "info" and complete["request_id"] == done["id"]
    assert complete["prompt_tokens"] == done["usage"]["prompt_tokens"] > len(LONG_PROMPT) - 1
    assert complete["completion_tokens"] == done["usage"]["completion_tokens"] == 5
    assert 0 < complete["ttft_ms"] <= complete["duration_ms"]
    stream = by_route["POST", "/v1/chat/completions", 200]
    assert streamed.status == 200 and stream["completion_tokens"] == 3
    assert 0 < stream["ttft_ms"] <= stream["duration_ms"]
    refused = by_route["POST", "/v1/completions", 400]
    assert bad.status == 400 and refused["level"] == "info" and "ttft_ms" not in refused
    assert card.status == 200 and by_route["GET", "/v1/models/{model}", 200]["level"] == "info"
    assert by_route["GET", "/metrics", 200]["level"] == "debug"  # scraped every few seconds


async def test_the_logged_max_model_len_is_the_one_v1_models_reports(nats_server):
    """A decode pool smaller than the model's 4,096-token context: the router logs the pool's
    size as max_model_len, once, and /v1/models says the same; the start-up line names the
    model's context for what it is."""
    spec = model_spec(tiny_config())
    advert = idle_advert(
        "decode-x", None, block_bytes=1, block_size=16, kv_spec="k", total_blocks=100
    )
    advert = with_fields(advert, model_spec=spec)
    names = ("kvmesh.services.router.dispatch", "kvmesh.services.router.service")
    with captured(*names) as log:
        async with (
            mesh_and_router(nats_server) as (_, _, http),
            connect_nats(nats_server, "decode-stand-in") as nc,
        ):
            for _ in range(3):  # every heartbeat re-advertises: logged the first time only
                subject = Subjects(DEFAULT_MESH).REGISTRY_ADVERTISE
                await nc.publish(subject, encode_message(advert))
                await flush_to_server(nc)
            for _ in range(100):
                (card,) = (await (await http.get("/v1/models")).json())["data"]
                if card["max_model_len"] != 4096:
                    break
                await asyncio.sleep(0.05)
            tokenized = await (
                await http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
            ).json()
    logged = [e["max_model_len"] for e in log.events if "max_model_len" in e]
    assert logged == [card["max_model_len"]] == [tokenized["max_model_len"]] == [100 * 16]
    (start,) = [e for e in log.events if e["event"] == "router serving"]
    assert start["model_context"] == 4096


def test_the_context_is_the_model_s_until_a_smaller_pool_is_heard() -> None:
    capacity = PoolCapacity("m", model_len=4096)
    assert capacity.context(0.0) == 4096
    advert = idle_advert("d", None, block_bytes=1, block_size=16, kv_spec="k", total_blocks=1000)
    capacity.note(with_fields(advert, model_spec="m"), 0)
    assert capacity.context(1.0) == 4096  # a pool of 16,000 tokens: the model's context binds
    capacity.note(with_fields(advert, model_spec="m", total_blocks=10), 0)
    assert capacity.context(1.0) == 160
