"""Structured outputs: the grammar a request's output must follow (``StructuredOutputs``, vLLM's
``structured_outputs`` shape) and its xgrammar ``Grammar``.

One of ``json`` (a JSON Schema), ``json_object`` (any JSON object), ``regex``, ``choice`` (one
of these strings) or ``grammar`` (EBNF, xgrammar's dialect of GBNF). The router maps OpenAI's
``response_format`` and vLLM's ``guided_*`` fields onto it and checks it builds (a 400 saying
why it does not); the workers compile it against their vocabulary (cached) and mask the logits
where they sample (``shared/engine/grammar.py``). JSON is generated compact (no whitespace
between tokens but what the schema's strings hold) and strictly (no property the schema does
not name), as OpenAI's ``strict`` structured outputs.

Torch-free until ``build_grammar`` is called: xgrammar imports torch, so the router loads it
on the first request that asks for a structured output, never at start.
"""

from __future__ import annotations

import json as jsonlib
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

if TYPE_CHECKING:
    import xgrammar

MAX_SPEC_CHARS = 65_536  # a schema, regex or grammar
MAX_CHOICES = 256


class StructuredOutputError(ValueError):
    """A structured output that does not build; the message says why (xgrammar's words)."""


class StructuredOutputs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Exactly one of the fields: what the output must be."""

    json: (
        Annotated[str, Meta(max_length=MAX_SPEC_CHARS, description="A JSON Schema, as JSON text")]
        | None
    ) = None
    json_object: Annotated[bool, Meta(description="Any JSON object")] = False
    regex: Annotated[str, Meta(min_length=1, max_length=MAX_SPEC_CHARS)] | None = None
    choice: (
        Annotated[
            tuple[str, ...], Meta(min_length=1, max_length=MAX_CHOICES, description="One of these")
        ]
        | None
    ) = None
    grammar: (
        Annotated[
            str, Meta(min_length=1, max_length=MAX_SPEC_CHARS, description="EBNF (xgrammar's GBNF)")
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {given or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))


_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def json_schema_text(schema: Any) -> str:
    """A schema object (or its JSON text) as the compact JSON text ``StructuredOutputs.json``
    holds (property order kept: it is the order the output writes them in)."""
    if isinstance(schema, str):
        text = schema
        try:
            schema = jsonlib.loads(text)
        except ValueError as exc:
            raise StructuredOutputError(f"the JSON schema is not JSON: {exc}") from None
        except RecursionError:  # as given: the router's depth limit measures it from the text
            return text.strip()
    if not isinstance(schema, dict):
        raise StructuredOutputError(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        return jsonlib.dumps(schema, separators=(",", ":"))
    except RecursionError:
        raise StructuredOutputError(
            "the JSON schema nests objects and arrays too deep to encode (far past the "
            "router's max_schema_depth)"
        ) from None


def build_grammar(spec: StructuredOutputs) -> xgrammar.Grammar:
    """The xgrammar Grammar of ``spec``; StructuredOutputError says why it does not build."""
    import xgrammar as xgr  # imports torch: only where a structured output is asked for

    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False, strict_mode=True)
        if spec.json_object:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(jsonlib.dumps, spec.choice)))
        assert spec.grammar is not None
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise StructuredOutputError(_reason(str(exc))) from None


def _reason(message: str) -> str:
    """xgrammar's ``[12:00:00] /project/cpp/file.cc:94: Unclosed '['`` without its prefix."""
    head, sep, tail = message.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        message = tail
    return message.strip()
