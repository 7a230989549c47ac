"""Structured outputs asked for over HTTP -> one ``StructuredOutputs`` (pure, but ``check``).

Four spellings, one at a time: OpenAI's ``response_format`` (``json_object``, ``json_schema``;
``text`` is none), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and vLLM's ``structured_outputs`` object. ``check`` refuses a spec past
the router's ``SchemaLimits`` (``shared/text/schema_limits.py``: deep or wide schemas take
xgrammar seconds to build), then builds the grammar (xgrammar, loaded on first use: it imports
torch) so that a bad schema, regex or grammar is a 400 that says why, before the request reaches
the mesh; verdicts are cached.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec
from kvmesh.services.router.errors import InvalidRequestError
from kvmesh.shared.text.schema_limits import SchemaLimitError, SchemaLimits, check_spec
from kvmesh.shared.text.structured_output import (
    StructuredOutputError,
    StructuredOutputs,
    build_grammar,
    json_schema_text,
)

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
FIELDS = ("response_format", *GUIDED, "structured_outputs")


def structured_outputs_of(body: Mapping[str, Any]) -> tuple[StructuredOutputs | None, str]:
    """The structured output ``body`` asks for and the field that asks (``""``: none)."""
    given = [name for name in FIELDS if body.get(name) is not None]
    if given and given[0] == "response_format" and _is_text(body["response_format"]):
        given = given[1:]
    if not given:
        return None, ""
    if len(given) > 1:
        raise InvalidRequestError(
            f"ask for one structured output, got {', '.join(map(repr, given))}",
            param=given[1],
            code="invalid_value",
        )
    (name,) = given
    value = body[name]
    try:
        return _spec(name, value), name
    except (StructuredOutputError, msgspec.ValidationError, ValueError) as exc:
        raise InvalidRequestError(f"'{name}': {exc}", param=name, code="invalid_value") from None


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1


def _spec(name: str, value: Any) -> StructuredOutputs:
    if name == "guided_json":
        return StructuredOutputs(json=json_schema_text(value))
    if name == "guided_regex":
        return msgspec.convert({"regex": value}, StructuredOutputs)
    if name == "guided_choice":
        return msgspec.convert({"choice": value}, StructuredOutputs)
    if name == "guided_grammar":
        return msgspec.convert({"grammar": value}, StructuredOutputs)
    if name == "structured_outputs":
        if isinstance(value, dict) and isinstance(value.get("json"), dict | str):
            value = {**value, "json": json_schema_text(value["json"])}
        return msgspec.convert(value, StructuredOutputs)
    return _response_format(value)


def _response_format(value: Any) -> StructuredOutputs:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        return StructuredOutputs(json_object=True)
    if kind == "json_schema" and set(value) == {"type", "json_schema"}:
        spec = value["json_schema"]
        known = {"name", "schema", "strict", "description"}
        if not isinstance(spec, dict) or not set(spec) <= known or "schema" not in spec:
            raise ValueError(
                "json_schema must be an object of name, schema (required), strict and description"
            )
        if spec.get("strict") is False:
            raise ValueError(
                "json_schema.strict=false is not supported: the output follows the schema "
                "strictly (leave it out or send true)"
            )
        return StructuredOutputs(json=json_schema_text(spec["schema"]))
    raise ValueError(
        "takes {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
        f"'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got type {kind!r}"
    )


def may_ask(raw: bytes) -> bool:
    """Whether a body might ask for a structured output (then it is prepared off the event
    loop: the first ``check`` loads xgrammar)."""
    return any(_QUOTED[name] in raw for name in FIELDS)


_QUOTED = {name: f'"{name}"'.encode() for name in FIELDS}


def check(spec: StructuredOutputs, param: str, limits: SchemaLimits) -> None:
    """InvalidRequestError (naming ``param``) if ``spec`` is past ``limits`` (the message names
    the limit) or does not build. Slow the first time (xgrammar's import): call it off the
    event loop."""
    try:
        check_spec(spec, limits)
    except SchemaLimitError as exc:
        raise InvalidRequestError(
            f"'{param}' is too complex to compile: {exc}", param=param, code="invalid_value"
        ) from None
    reason = _build_error(spec)
    if reason is not None:
        raise InvalidRequestError(
            f"'{param}' does not build a grammar: {reason}", param=param, code="invalid_value"
        )


@functools.lru_cache(maxsize=256)
def _build_error(spec: StructuredOutputs) -> str | None:
    try:
        build_grammar(spec)
    except StructuredOutputError as exc:
        return str(exc)
    return None
