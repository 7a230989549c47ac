"""Tools on /v1/chat/completions, the pure parts: the request's validation (services/router/tools.py,
api.py), the prompt a template without tools gets and the one a template with tools gets
(shared/text/tool_prompt.py), the forced choice's grammar, and the answer's shapes."""

from __future__ import annotations

import copy
import dataclasses
import json

import msgspec
import pytest
from jsonschema import Draft202012Validator
from kvmesh.services.router.api import parse_chat
from kvmesh.services.router.choices import Choice
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.errors import ApiError
from kvmesh.services.router.prompt import tokenize
from kvmesh.services.router.responses import ResponseBuilder
from kvmesh.services.router.tools import check_tools
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.model.tiny import tiny_tokenizer
from kvmesh.shared.text.structured_output import build_grammar
from support.tool_specs import WEATHER_TOOL as WEATHER

MODEL = "kvmesh-tiny"
TIME = {"type": "function", "function": {"name": "get_time"}}
LIMITS = RouterConfig().schema_limits()
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def chat(messages=USER, **body):
    return parse_chat({"model": MODEL, "messages": messages, **body}, MODEL)


def refused(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == 400
    return info.value


def test_tool_choice_naming_an_unknown_function_is_400_naming_it():
    err = refused(
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_stock"}}
    )
    assert err.param == "tool_choice" and "'get_stock'" in err.message
    assert "'get_weather'" in err.message  # and says which there are


def test_tool_choice_forcing_a_call_without_tools_is_400():
    assert refused(tool_choice="required").param == "tool_choice"
    assert chat(tool_choice="none").tools is None and chat(tool_choice="auto").tools is None


def test_tools_with_a_bad_name_a_twice_named_function_or_no_object_schema_are_400():
    bad_name = {"type": "function", "function": {"name": "get weather!"}}
    assert refused(tools=[bad_name]).param == "tools[0].function.name"
    assert refused(tools=[WEATHER, WEATHER]).param == "tools"
    scalar = copy.deepcopy(WEATHER)
    scalar["function"]["parameters"] = {"type": "string"}
    assert refused(tools=[scalar]).param == "tools[0].function.parameters"


def test_tools_with_an_invalid_schema_are_400_naming_the_function():
    broken = copy.deepcopy(WEATHER)
    broken["function"]["parameters"]["properties"]["city"] = {"type": "foo"}
    request = chat(tools=[TIME, broken])  # any tool_choice: auto here
    with pytest.raises(ApiError) as info:
        check_tools(request.tools, LIMITS)
    assert info.value.status == 400 and info.value.param == "tools[1].function.parameters"


def test_tool_parameters_past_the_schema_limits_are_400_naming_the_limit():
    deep: dict = {"type": "object"}
    node = deep
    for _ in range(10):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    tool = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    with pytest.raises(ApiError) as info:
        check_tools(chat(tools=[tool]).tools, dataclasses.replace(LIMITS, max_schema_depth=4))
    assert info.value.param == "tools[0].function.parameters" and "depth" in info.value.message


def test_forced_tool_choice_with_a_response_format_is_400():
    err = refused(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert err.param == "tool_choice"


def test_tool_message_without_tool_call_id_or_calls_with_bad_arguments_are_400():
    assert refused(messages=[{"role": "tool", "content": "22 C"}]).param == (
        "messages[0].tool_call_id"
    )
    bad_call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
        ],
    }
    assert refused(messages=[*USER, bad_call]).param == (
        "messages[1].tool_calls[0].function.arguments"
    )
    user_call = {**bad_call, "role": "user", "content": "x"}
    assert refused(messages=[user_call]).param == "messages[0].tool_calls"


@pytest.mark.parametrize(
    "choice, parallel, sample",
    [
        (
            {"type": "function", "function": {"name": "get_weather"}},
            True,
            {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
        ),
        ("required", False, {"name": "get_time", "arguments": {}}),
        (
            "required",
            True,
            [
                {"name": "get_time", "arguments": {}},
                {"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}},
            ],
        ),
    ],
    ids=["named", "required-one", "required-parallel"],
)
def test_forced_tool_choice_asks_for_the_call_grammar(choice, parallel, sample):
    request = chat(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel)
    spec = request.sampling.structured_outputs
    assert spec is not None and request.structured_param == "tools"
    schema = json.loads(spec.json)
    Draft202012Validator(schema).validate(sample)
    wrong = {"name": "get_weather", "arguments": {"city": "Oslo"}}  # misses unit
    assert not Draft202012Validator(schema).is_valid(wrong if not parallel else [wrong])
    build_grammar(spec)  # xgrammar takes it


def test_auto_tool_choice_asks_for_no_grammar():
    request = chat(tools=[WEATHER])
    assert request.tools.choice == "auto" and request.sampling.structured_outputs is None


def _prompt_text(tokenizer, request) -> str:
    prompt = tokenize(request, tokenizer, 4096)
    return tokenizer.decode(list(prompt.prompt_ids), skip_special_tokens=False)


def test_tools_render_into_the_system_message_when_the_template_has_none(tokenizer):
    history = [
        {"role": "system", "content": "be brief"},
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"},
    ]
    text = _prompt_text(tokenizer, chat(history, tools=[WEATHER]))
    assert text.startswith("<|bos|><|system|>be brief\n\nYou are a function calling AI model.")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in (
        text
    )
    assert "<|user|><tool_response>\n22 C\n</tool_response><|end|><|assistant|>" in text
    # tool_choice none: the model is shown no tools, the history still renders
    hidden = _prompt_text(tokenizer, chat(history, tools=[WEATHER], tool_choice="none"))
    assert "<tools>" not in hidden and "<tool_response>" in hidden


def test_tools_reach_a_template_that_renders_them_itself(tokenizer):
    own = copy.copy(tokenizer)
    own.chat_template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}call:{{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}"
    )
    own._template = None
    call = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
    }
    history = [
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "30 C"},
    ]
    text = _prompt_text(own, chat(history, tools=[WEATHER, TIME]))
    assert text == (
        "[get_weather][get_time]<user>Weather in Paris?<assistant>call:Lima<tool>30 C#call_9"
    )


def _answer(tokenizer, request, text: str, stream: bool):
    """The chat answer (full, or the stream's chunks) of a choice that wrote ``text``."""
    prompt = tokenize(request, tokenizer, 4096)
    fmt = request.tools.output_format("hermes")
    choice = Choice.new(0, tokenizer, prompt.prompt_ids, prompt.sampling, True, None, fmt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    builder = ResponseBuilder.for_request(request, "chatcmpl-1")
    if not stream:
        choice.add(TokenEvent(request_id="r", token_ids=tuple(ids), finish_reason="stop"))
        return builder.full([choice.result()], None)  # type: ignore[arg-type]
    chunks = []
    for i, token in enumerate(ids):
        done = "stop" if i == len(ids) - 1 else None
        piece, _ = choice.add(TokenEvent(request_id="r", token_ids=(token,), finish_reason=done))
        for delta in choice.tool_deltas(piece + (choice.output.finish() if done else "")):
            if isinstance(delta, str):
                chunks.append(builder.text_chunk(delta))
            else:
                chunks.append(builder.tool_chunk(delta))
    chunks.append(builder.finish_chunk(choice.api_finish_reason))
    return chunks


def test_chat_answer_with_calls_has_tool_calls_and_finish_reason_tool_calls(tokenizer):
    request = chat(tools=[WEATHER])
    text = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    answer = _answer(tokenizer, request, text, stream=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    chunks = _answer(tokenizer, request, text, stream=True)
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices[0].delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is msgspec.UNSET for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == call.function.arguments
    assert len(calls) > 2  # the arguments came in pieces, as they were written
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_answer_without_calls_stays_text_with_finish_reason_stop(tokenizer):
    answer = _answer(tokenizer, chat(tools=[WEATHER]), "It is sunny.", stream=False)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content == "It is sunny."
    assert "tool_calls" not in json.loads(msgspec.json.encode(answer))["choices"][0]["message"]
