"""Structured outputs past the router's static limits (issue 40): a schema nested 600 deep or an
``anyOf`` nested 1,000 deep is a 400 naming the limit before anything reaches the mesh (it held a
decode worker's event loop for seconds); each measure of the pure checker on its own."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.service import serve_router
from kvmesh.shared.text.schema_limits import (
    SchemaLimitError,
    SchemaLimits,
    SchemaSize,
    check_spec,
    schema_size,
    spec_size,
    text_depth,
)
from kvmesh.shared.text.structured_output import StructuredOutputs, json_schema_text
from support.router_fake_mesh import FakeMesh

LIMITS = RouterConfig().schema_limits()


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def nested_any_of_text(depth: int) -> str:
    """A schema of ``anyOf`` nested ``depth`` deep, as text."""
    text = '{"type":"integer"}'
    for _ in range(depth):
        text = '{"anyOf":[' + text + ',{"type":"string"}]}'
    return text


def nested_text(depth: int) -> str:
    """``nested_arrays(depth)`` as text, built without json.dumps (which recurses)."""
    text = '{"type":"integer"}'
    for _ in range(depth):
        text = '{"type":"array","items":' + text + "}"
    return text


def limit_of(spec: StructuredOutputs, limits: SchemaLimits = LIMITS) -> str | None:
    try:
        check_spec(spec, limits)
    except SchemaLimitError as exc:
        return exc.limit
    return None


def test_defaults_are_the_router_flags_and_each_must_be_positive():
    assert SchemaLimits(64, 4096, 512, 128, 1000) == LIMITS
    with pytest.raises(ValueError, match="max_schema_refs"):
        dataclasses.replace(LIMITS, max_schema_refs=0)
    with pytest.raises(ValueError, match="max_schema_depth"):
        RouterConfig(max_schema_depth=0)


def test_schema_size_counts_depth_nodes_branches_refs_and_patterns():
    schema = {
        "type": "object",
        "properties": {
            "a": {
                "anyOf": [{"type": "string", "pattern": "^[a-z]{3}[0-9]*$"}, {"$ref": "#/$defs/b"}]
            },
            "c": {"oneOf": [{"type": "null"}], "allOf": [{}, {}]},
        },
        "patternProperties": {"^x-[0-9]+$": {"type": "integer"}},
        "$defs": {"b": {"type": "integer"}},
    }
    # depth: root > properties > a > anyOf > [0]; nodes: every object and array
    assert schema_size(schema) == SchemaSize(
        depth=5, nodes=16, branches=5, refs=1, regex_chars=len("^[a-z]{3}[0-9]*$")
    )
    assert schema_size({}) == SchemaSize(depth=1, nodes=1)
    assert schema_size(nested_arrays(600)).depth == 601


def test_each_limit_is_named_when_it_alone_is_over():
    wide = {"anyOf": [{"type": "integer"}] * 513}
    refs = {"type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/x"} for i in range(129)}}
    many = {"type": "object", "properties": {f"p{i}": {} for i in range(4096)}}
    pattern = {"type": "string", "pattern": "a" * 1001}
    cases = {
        "max_schema_depth": StructuredOutputs(json=json_schema_text(nested_arrays(64))),
        "max_schema_branches": StructuredOutputs(json=json_schema_text(wide)),
        "max_schema_refs": StructuredOutputs(json=json_schema_text(refs)),
        "max_schema_nodes": StructuredOutputs(json=json_schema_text(many)),
        "max_regex_chars": StructuredOutputs(json=json_schema_text(pattern)),
    }
    for limit, spec in cases.items():
        assert limit_of(spec) == limit
    assert limit_of(StructuredOutputs(regex="a" * 1001)) == "max_regex_chars"
    # just under each: allowed
    assert limit_of(StructuredOutputs(json=json_schema_text(nested_arrays(31)))) is None
    assert limit_of(StructuredOutputs(regex="a" * 1000)) is None
    assert limit_of(StructuredOutputs(grammar='root ::= "a"')) is None
    assert limit_of(StructuredOutputs(json="not json")) is None  # the build says why


def test_the_error_names_the_limit_its_flag_and_the_value():
    with pytest.raises(SchemaLimitError) as info:
        check_spec(StructuredOutputs(json=json_schema_text(nested_arrays(600))), LIMITS)
    message = str(info.value)
    assert "601" in message and "64" in message and "--max-schema-depth" in message
    assert (info.value.limit, info.value.value) == ("max_schema_depth", 601)


def test_a_schema_too_deep_for_the_json_parser_is_measured_from_its_text():
    text = nested_text(2600)  # ~64 KiB: what the body limit lets through
    assert spec_size(StructuredOutputs(json=text)).depth == 2601
    assert limit_of(StructuredOutputs(json=text)) == "max_schema_depth"
    assert limit_of(StructuredOutputs(json=json_schema_text(nested_any_of_text(1000)))) == (
        "max_schema_depth"
    )
    assert text_depth('{"a":"[[[{\\"]","b":[1,[2]]}') == 3  # brackets in strings do not count


@pytest.fixture
async def router(nats_server):
    config = RouterConfig(nats_url=nats_server, host="127.0.0.1", port=0)
    async with FakeMesh(nats_server).running() as mesh, serve_router(config) as running:
        yield running, mesh


async def test_deep_schemas_are_400_naming_the_limit_before_the_mesh_sees_them(router):
    running, mesh = router
    bodies = {
        "arrays 600 deep": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": nested_text(600)},
            }
        },
        "anyOf 1,000 deep": {"guided_json": nested_any_of_text(1000)},
        "arrays 2,600 deep": {"structured_outputs": {"json": nested_text(2600)}},
    }
    async with aiohttp.ClientSession() as session:
        for name, extra in bodies.items():
            body = {"model": "kvmesh-tiny", "prompt": "hi", "max_tokens": 4, **extra}
            async with session.post(f"{running.url}/v1/completions", json=body) as resp:
                assert resp.status == 400, name
                error = (await resp.json())["error"]
            assert error["type"] == "invalid_request_error", name
            assert "max_schema_depth" in error["message"], (name, error)
            assert error["param"] == next(iter(extra)), name
        ok = {"model": "kvmesh-tiny", "prompt": "hi", "max_tokens": 4}
        ok["guided_json"] = nested_arrays(8)
        async with session.post(f"{running.url}/v1/completions", json=ok) as resp:
            assert resp.status == 200, await resp.text()
    assert len(mesh.places) == 1  # only the request within the limits was placed
