"""The official ``openai`` client against the router: completions and chat, streamed and not, the
streamed deltas adding up to the non-streamed text, and errors mapped onto the client's types.

First against the fake peer of tests/support/router_fake_mesh.py (real NATS, real protocol messages), then
against the real mesh: kv-registry, decode, prefill and router started as `kvmesh serve` processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import orjson
import pytest
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.service import serve_router
from kvmesh.shared.config.ports import free_port
from support.router_fake_mesh import REPLY_TEXT, FakeMesh

MODEL = "kvmesh-tiny"
MESSAGES = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hello"}]


@contextlib.asynccontextmanager
async def client_for(nats_url: str, mesh: FakeMesh | None = None, **router):
    mesh = mesh or FakeMesh(nats_url)
    config = RouterConfig(nats_url=nats_url, host="127.0.0.1", port=0, **router)
    async with mesh.running(), serve_router(config) as running:
        client = openai.AsyncOpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
        try:
            yield client
        finally:
            await client.close()


async def test_completion_stream_deltas_concatenate_to_the_full_text(nats_server):
    async with client_for(nats_server) as client:
        full = await client.completions.create(model=MODEL, prompt="x" * 80, max_tokens=20)
        stream = await client.completions.create(
            model=MODEL, prompt="x" * 80, max_tokens=20, stream=True
        )
        pieces = [chunk async for chunk in stream]
    assert full.choices[0].text == REPLY_TEXT[:20]
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    assert "".join(c.choices[0].text for c in pieces) == full.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


async def test_chat_stream_deltas_concatenate_to_the_full_message(nats_server):
    async with client_for(nats_server) as client:
        full = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=100, seed=1, temperature=0.7
        )
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=100,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    message = full.choices[0].message
    assert (message.role, message.content) == ("assistant", REPLY_TEXT)
    assert full.choices[0].finish_reason == "stop"
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


async def test_stop_strings_apply_to_streamed_and_full_text_alike(nats_server):
    async with client_for(nats_server) as client:
        kwargs = {"model": MODEL, "prompt": "hi", "max_tokens": 60, "stop": ["lazy"]}
        full = await client.completions.create(**kwargs)
        stream = await client.completions.create(**kwargs, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream])
    assert full.choices[0].text == streamed == "The quick brown fox jumps over the "
    assert full.choices[0].finish_reason == "stop"


async def test_models_list_names_the_served_model(nats_server):
    async with client_for(nats_server) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_client_error_types_match_status(nats_server):
    async with client_for(nats_server) as client:
        with pytest.raises(openai.NotFoundError) as not_found:
            await client.completions.create(model="gpt-4o", prompt="x")
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=17)
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=10**6)
    assert not_found.value.status_code == 404 and "kvmesh-tiny" in not_found.value.message
    assert bad.value.body["param"] == "n"
    assert too_long.value.body["code"] == "context_length_exceeded"


async def test_full_admission_queue_raises_rate_limit_error(nats_server):
    mesh = FakeMesh(nats_server, hold_tokens=True)
    async with client_for(nats_server, mesh, max_concurrent_requests=1) as client:
        held = asyncio.create_task(client.completions.create(model=MODEL, prompt="x"))
        while not mesh.places:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
    assert info.value.response.headers["retry-after"] == "1"


async def test_error_mid_stream_raises_api_error(nats_server):
    async with client_for(nats_server, FakeMesh(nats_server, fail_with="worker died")) as client:
        stream = await client.completions.create(model=MODEL, prompt="x", stream=True)
        with pytest.raises(openai.APIError, match="worker died"):
            async for _ in stream:
                pass


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
# every option the official client can send: its own keyword arguments, and vLLM's in extra_body
COMMON = {
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 3,
    "n": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "stop": ["zzz"],
    "logit_bias": {"65": 2.5},
}
VLLM = {
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "stop_token_ids": [7],
    "include_stop_str_in_output": True,
    "ignore_eos": True,
    "prompt_logprobs": 1,
    "user": "ignored",
}


async def test_every_option_reaches_the_mesh_through_the_official_client(nats_server):
    """Each option the client sends arrives in the SamplingOptions the mesh is asked to run,
    and the answers parse as the client's own types (choices, logprobs)."""
    from kvmesh.shared.text.sampling import SamplingOptions
    from kvmesh.shared.text.structured_output import StructuredOutputs, json_schema_text

    mesh = FakeMesh(nats_server)
    schema_format = {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": SCHEMA, "strict": True},
    }
    async with client_for(nats_server, mesh) as client:
        done = await client.completions.create(
            model=MODEL,
            prompt="x" * 10,
            max_tokens=8,
            logprobs=3,
            echo=True,
            extra_body={**VLLM, "guided_regex": "[a-z]+"},
            **COMMON,
        )
        chat = await client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=8,
            logprobs=True,
            top_logprobs=2,
            response_format=schema_format,
            extra_body=VLLM,
            **COMMON,
        )
        spellings = [
            ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
            (
                {"extra_body": {"guided_json": SCHEMA}},
                StructuredOutputs(json=json_schema_text(SCHEMA)),
            ),
            ({"extra_body": {"guided_choice": ["a", "b"]}}, StructuredOutputs(choice=("a", "b"))),
            (
                {"extra_body": {"guided_grammar": 'root ::= "a"'}},
                StructuredOutputs(grammar='root ::= "a"'),
            ),
            (
                {"extra_body": {"structured_outputs": {"regex": "b+"}}},
                StructuredOutputs(regex="b+"),
            ),
        ]
        for kwargs, _ in spellings:
            await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_completion_tokens=4, **kwargs
            )
    shared = {
        **{k: v for k, v in COMMON.items() if k != "logit_bias"},
        **{k: v for k, v in VLLM.items() if k != "user"},
        "stop": ("zzz",),
        "stop_token_ids": (7,),
        "logit_bias": {65: 2.5},
        "max_tokens": 8,
    }
    completion_place, chat_place, *others = mesh.places
    # echo with logprobs=3 asks the prompt's top 3 too: the larger of that and prompt_logprobs
    assert completion_place.sampling == SamplingOptions(
        **{**shared, "prompt_logprobs": 3},
        logprobs=3,
        structured_outputs=StructuredOutputs(regex="[a-z]+"),
    )
    assert chat_place.sampling == SamplingOptions(
        **shared, logprobs=2, structured_outputs=StructuredOutputs(json=json_schema_text(SCHEMA))
    )
    assert [p.sampling.structured_outputs for p in others] == [spec for _, spec in spellings]
    assert sorted(c.index for c in done.choices) == [0, 1]
    for choice in done.choices:  # echo: the prompt's tokens lead, the first without a logprob
        assert choice.text.startswith("x" * 10)
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == len(choice.logprobs.top_logprobs)
    assert done.choices[0].model_extra["prompt_logprobs"][0] is None
    for choice in chat.choices:
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        assert len(choice.logprobs.content) == 8
    assert chat.model_extra["prompt_logprobs"][0] is None


async def test_streamed_chat_logprobs_add_up_to_the_full_answers(nats_server):
    async with client_for(nats_server) as client:
        kwargs = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 12, "n": 2}
        full = await client.chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
        stream = await client.chat.completions.create(
            logprobs=True, top_logprobs=2, stream=True, **kwargs
        )
        chunks = [c async for c in stream]
    for choice in full.choices:
        streamed = [
            entry
            for c in chunks
            for part in c.choices
            if part.index == choice.index and part.logprobs
            for entry in part.logprobs.content
        ]
        assert streamed == choice.logprobs.content
        assert len(streamed) == 12 and all(len(e.top_logprobs) == 2 for e in streamed)


# --- the real mesh ---------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
DECODE_BLOCKS = 64


def _serve(service: str, nats_url: str, log_dir: Path, *flags: str) -> subprocess.Popen:
    log = open(log_dir / f"{service}.log", "wb")  # noqa: SIM115 (closed by the child's exit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    cmd = [sys.executable, "-m", "kvmesh.cli", "serve", service, "--nats-url", nats_url, *flags]
    try:
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _post_ok(url: str, body: dict) -> bool:
    request = urllib.request.Request(
        url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="module")
def real_mesh(nats_server_module: str, tmp_path_factory) -> Iterator[str]:
    """The prefill-queue keeper, kv-registry, one decode and one prefill worker and the router
    as processes; yields the router's base URL once a completion goes through end to end."""
    logs = tmp_path_factory.mktemp("mesh-logs")
    port = free_port()
    procs = [
        _serve("prefill-queue", nats_server_module, logs),  # makes the queue; no role may
        _serve("kv-registry", nats_server_module, logs),
        # 64 blocks of 16 tokens: a pool smaller than the model's 4096-token context
        _serve("decode", nats_server_module, logs, "--num-blocks", str(DECODE_BLOCKS)),
        _serve("prefill", nats_server_module, logs),
        _serve("router", nats_server_module, logs, "--host", "127.0.0.1", "--port", str(port)),
    ]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            dead = [p.args[4] for p in procs if p.poll() is not None]
            assert not dead, f"{dead} exited on start; logs in {logs}"
            if _post_ok(
                f"{url}/v1/completions", {"model": MODEL, "prompt": "ping", "max_tokens": 1}
            ):
                break
            assert time.monotonic() < deadline, f"the mesh did not come up; logs in {logs}"
            time.sleep(0.5)
        yield url
    finally:
        _stop(procs)


@pytest.mark.slow
@pytest.mark.parametrize("prompt_len", [8, 100], ids=["local-prefill", "remote-prefill"])
async def test_real_mesh_completion_stream_matches_full_text(real_mesh, prompt_len):
    client = openai.AsyncOpenAI(base_url=f"{real_mesh}/v1", api_key="unused", max_retries=0)
    kwargs = {"model": MODEL, "prompt": "a" * prompt_len, "max_tokens": 12, "temperature": 0}
    async with client:
        full = await client.completions.create(**kwargs)
        stream = await client.completions.create(**kwargs, stream=True)
        streamed = "".join([c.choices[0].text async for c in stream])
    assert full.usage.prompt_tokens == prompt_len + 1  # BOS
    assert full.usage.completion_tokens <= 12
    assert full.choices[0].finish_reason in ("stop", "length")
    assert streamed == full.choices[0].text


@pytest.mark.slow
async def test_real_mesh_chat_stream_and_metrics(real_mesh):
    client = openai.AsyncOpenAI(base_url=f"{real_mesh}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "tell me about disaggregated serving " * 3}]
    kwargs = {"model": MODEL, "messages": messages, "max_completion_tokens": 10, "seed": 5}
    async with client:
        full = await client.chat.completions.create(**kwargs)
        stream = await client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        # Several requests at once share the decode batch.
        many = await asyncio.gather(*(client.chat.completions.create(**kwargs) for _ in range(4)))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content  # same seed: same tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert {m.choices[0].message.content for m in many} == {full.choices[0].message.content}
    with urllib.request.urlopen(f"{real_mesh}/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[:1] != "#")
    assert float(samples["kvmesh_router_prefill_compute_seconds_count"]) >= 1  # remote prefill
    assert float(samples["kvmesh_router_kv_transfer_seconds_count"]) >= 1
    assert float(samples["kvmesh_router_time_to_first_token_seconds_count"]) >= 7


@pytest.mark.slow
async def test_real_mesh_models_report_the_context_the_kv_pool_admits(real_mesh):
    """/v1/models' max_model_len is the decode worker's pool (64 x 16 tokens), not the model's
    4096: a prompt that fits the model but not the pool is a 400 naming the setting."""
    client = openai.AsyncOpenAI(base_url=f"{real_mesh}/v1", api_key="unused", max_retries=0)
    async with client:
        deadline = time.monotonic() + 10
        while True:  # the router learns the pool from the worker's advert (each heartbeat)
            (card,) = (await client.models.list()).data
            if card.model_extra["max_model_len"] != 4096 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        with pytest.raises(openai.BadRequestError) as too_long:
            await client.completions.create(model=MODEL, prompt="a" * 1100, max_tokens=1)
        fits = await client.completions.create(model=MODEL, prompt="a" * 1000, max_tokens=4)
    assert card.model_extra["max_model_len"] == DECODE_BLOCKS * 16
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert "--num-blocks" in too_long.value.message
    assert fits.usage.prompt_tokens == 1001
