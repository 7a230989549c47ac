"""Tool-call parsers (shared/text/tool_calls.py): hermes, llama3_json and the bare JSON of a forced
tool choice, whole and streamed in every split; the pieces of a stream add up to the whole."""

from __future__ import annotations

import json

import pytest
from kvmesh.shared.text.tool_calls import (
    CallDelta,
    ParsedCall,
    ToolCallStream,
    default_parser,
    parse,
)

WEATHER = '{"city": "Paris", "days": [1, {"note": "a } and a ]"}], "q": "say \\"hi\\""}'
OUTPUTS = {
    "hermes-two-calls-and-text": (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        '</tool_call>\n<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>\n',
        "Let me look.",
        [("get_weather", WEATHER), ("f", '{"x": 1}')],
    ),
    "hermes-text-only": ("hermes", "Paris is in France. <tool", "Paris is in France. <tool", []),
    "hermes-bad-json-is-text": (
        "hermes",
        "<tool_call>{not json}</tool_call>",
        "<tool_call>{not json}</tool_call>",
        [],
    ),
    "llama3-json-two-calls": (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "parameters": {}}',
        None,
        [("a", '{"q": "x;y"}'), ("b", "{}")],
    ),
    "llama3-json-text": ("llama3_json", "Hello {there}", "Hello {there}", []),
    "forced-array": (
        "json",
        '[{"name":"a","arguments":{"k":1}},{"name":"b","arguments":{"z":"w"}}]',
        None,
        [("a", '{"k":1}'), ("b", '{"z":"w"}')],
    ),
    "forced-object": ("json", '{"name":"a","arguments":{"k":12}}', None, [("a", '{"k":12}')]),
}


def _streamed(fmt: str, text: str, size: int) -> tuple[str | None, list[tuple[str, str]]]:
    stream = ToolCallStream(fmt)  # type: ignore[arg-type]
    deltas = []
    for i in range(0, len(text), size):
        deltas += stream.add(text[i : i + size])
    deltas += stream.finish()
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, CallDelta):
            if d.id is not None:
                assert d.index not in calls and d.name and d.id.startswith("call_")
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    content = "".join(d for d in deltas if isinstance(d, str))
    return content or None, [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_parse_finds_text_and_calls_in_each_format(name):
    fmt, text, content, calls = OUTPUTS[name]
    parsed = parse(text, fmt)
    assert parsed.content == content
    assert parsed.calls == tuple(ParsedCall(n, a) for n, a in calls)
    for call in parsed.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("name", list(OUTPUTS))
def test_streamed_pieces_add_up_to_the_parse_in_any_split(name, size):
    fmt, text, _, _ = OUTPUTS[name]
    parsed = parse(text, fmt)
    content, calls = _streamed(fmt, text, size)
    assert content == parsed.content
    assert calls == [(c.name, c.arguments) for c in parsed.calls]


def test_stream_sends_name_before_the_arguments_close_when_name_comes_first():
    stream = ToolCallStream("hermes")
    assert stream.add("Hi <tool_") == ["Hi"]  # the white space and a possible tag held back
    first = stream.add('call>{"name": "get_weather", "arguments": {"ci')
    assert len(first) == 2 and isinstance(first[0], CallDelta) and first[0].id is not None
    assert first == [
        CallDelta(0, id=first[0].id, name="get_weather"),
        CallDelta(0, arguments='{"ci'),
    ]
    assert stream.add('ty": "Oslo"}}</tool_call>') == [CallDelta(0, arguments='ty": "Oslo"}')]
    assert stream.finish() == [] and stream.num_calls == 1


def test_hermes_holds_a_partial_opening_tag_until_it_is_text():
    stream = ToolCallStream("hermes")
    assert stream.add("a <tool_ca") == ["a"]
    assert stream.add("t is here") == [" <tool_cat is here"]


def test_unclosed_hermes_call_at_the_end_is_a_call_when_its_json_is_whole():
    assert parse('<tool_call>{"name": "f", "arguments": {}}', "hermes").calls == (
        ParsedCall("f", "{}"),
    )
    assert parse('<tool_call>{"name": "f", "argu', "hermes").content == (
        '<tool_call>{"name": "f", "argu'
    )


def test_forced_output_cut_by_the_length_limit_has_no_calls():
    parsed = parse('[{"name":"a","arguments":{"k":1}},{"name":"b","argu', "json")
    assert parsed.calls == () and parsed.content is not None


def test_call_with_other_keys_or_non_object_arguments_is_text():
    assert parse('<tool_call>{"name": "f", "arguments": 3}</tool_call>', "hermes").calls == ()
    extra = '<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>'
    assert parse(extra, "hermes").calls == ()


@pytest.mark.parametrize(
    "template, parser",
    [
        (None, "hermes"),
        ("{{ messages }}", "hermes"),
        ("{% if tools %}<tool_call>{% endif %}", "hermes"),
        ('{{ "<|python_tag|>" }}{"name": ..., "parameters": ...}', "llama3_json"),
    ],
)
def test_default_parser_follows_the_chat_template(template, parser):
    assert default_parser(template) == parser


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_raw_control_characters_in_arguments_come_out_escaped(size):
    # a grammar lets a model write them raw in a string; strict JSON parsers refuse that
    text = '{"name": "f", "arguments": {"city": "a\x1cb\tc", "n": 1}}'
    (call,) = parse(text, "json").calls
    assert json.loads(call.arguments) == {"city": "a\x1cb\tc", "n": 1}
    assert call.arguments == '{"city": "a\\u001cb\\u0009c", "n": 1}'
    assert _streamed("json", text, size) == (None, [("f", call.arguments)])
