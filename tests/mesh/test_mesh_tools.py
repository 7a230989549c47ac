"""Tool calling through a real mesh with the official ``openai`` client: a forced tool choice
(``required``, a named function) answers ``tool_calls`` whose arguments parse and validate
against the function's schema every time, streamed and not, disaggregated with n-gram drafts and
colocated; a ``role: "tool"`` answer goes back into the conversation.

kvmesh-tiny has random weights: what it writes is noise, but a grammar holds it to the schema.
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from jsonschema import Draft202012Validator
from kvmesh.loadgen.bench_spec import DraftSetup, spec_mesh

pytestmark = pytest.mark.slow

MODEL = "kvmesh-tiny"
ENV = {"KVMESH_CHUNK_TOKENS": "256", "KVMESH_BLOCK_SIZE": "16", "KVMESH_NUM_BLOCKS": "512"}
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit", "days"],
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def mesh():
    with spec_mesh(DraftSetup("ngram", k=4), env=ENV) as launcher:
        yield launcher


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        Draft202012Validator(SCHEMAS[call.function.name]).validate(
            json.loads(call.function.arguments)
        )


async def _streamed(client, **kwargs):
    """A streamed answer's calls rebuilt from their deltas, and its finish reason."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True, **kwargs
    )
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                if delta.id is not None:
                    assert delta.index not in calls and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "args": ""}
                calls[delta.index]["args"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


def _as_objects(streamed):
    return [
        openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["args"]}
        )
        for c in streamed
    ]


async def _scenario(url: str, seeds: range):
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    async with client:
        forced = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=MODEL,
                    messages=MESSAGES,
                    tools=TOOLS,
                    tool_choice="required" if s % 2 else NAMED,
                    parallel_tool_calls=bool(s % 4 == 1),
                    max_completion_tokens=200,
                    seed=s,
                    temperature=0.8,
                )
                for s in seeds
            )
        )
        streamed, finish = await _streamed(
            client, tool_choice=NAMED, max_completion_tokens=200, seed=5, temperature=0.8
        )
        call = forced[0].choices[0].message.tool_calls[0]
        answered = await client.chat.completions.create(
            model=MODEL,
            messages=[
                *MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
            ],
            tools=TOOLS,
            max_completion_tokens=8,
            seed=1,
        )
    return forced, (streamed, finish), answered


def test_forced_tool_calls_validate_through_the_mesh_with_drafts(mesh):
    forced, (streamed, finish), answered = asyncio.run(_scenario(mesh.url, range(6)))
    for s, reply in enumerate(forced):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (s, choice)
        assert choice.message.content is None
        _check_calls(choice.message.tool_calls, tuple(SCHEMAS) if s % 2 else ("get_weather",))
        if s % 4 != 1:  # parallel_tool_calls false, or a named function: one call
            assert len(choice.message.tool_calls) == 1
    assert finish == "tool_calls" and len(streamed) == 1
    _check_calls(_as_objects(streamed), ("get_weather",))
    # the tool's answer went back through the template: an ordinary answer follows
    assert answered.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert answered.usage.prompt_tokens > forced[0].usage.prompt_tokens


def test_forced_tool_calls_validate_through_a_colocated_mesh():
    from kvmesh.testing.mesh import local_mesh

    with local_mesh("colocated", env=ENV) as colocated:
        forced, (streamed, finish), _ = asyncio.run(_scenario(colocated.url, range(2)))
    for reply in forced:
        assert reply.choices[0].finish_reason == "tool_calls"
        _check_calls(reply.choices[0].message.tool_calls)
    assert finish == "tool_calls"
    _check_calls(_as_objects(streamed), ("get_weather",))
