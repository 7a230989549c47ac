"""Static limits on a structured output, checked before any grammar is built (pure).

xgrammar's build time grows about as the cube of a JSON schema's nesting (arrays 500 deep: 6 s,
1,000: 52 s) and with its ``anyOf`` branches and ``$ref``s, so a 15 KB schema could hold a worker
for seconds. ``check_spec`` refuses such a spec at the router, before it reaches xgrammar or the
mesh, with ``SchemaLimitError`` naming the limit, its flag and the value found. The walk is
iterative: a schema nested thousands deep costs a loop, never a RecursionError.

What is measured (``SchemaSize``, in the schema's JSON document, whatever keyword a value sits
under): depth: objects and arrays nested in one another; nodes: objects and arrays in all;
branches: the entries of every ``anyOf``, ``oneOf`` and ``allOf``; refs: ``$ref`` keys; regex
characters: the longest ``pattern`` string or ``patternProperties`` key (or a ``regex`` spec).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from kvmesh.shared.text.structured_output import StructuredOutputs

BRANCHING = ("anyOf", "oneOf", "allOf")


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """The most a structured output may hold; the flags and their defaults are RouterConfig's
    (each field's flag is its name: ``max_schema_depth`` is ``--max-schema-depth``)."""

    max_schema_depth: int
    max_schema_nodes: int
    max_schema_branches: int
    max_schema_refs: int
    max_regex_chars: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"{f.name} must be >= 1, got {getattr(self, f.name)}")


@dataclass(frozen=True, slots=True)
class SchemaSize:
    """What a structured output holds, measured as ``SchemaLimits`` limits it."""

    depth: int = 0
    nodes: int = 0
    branches: int = 0
    refs: int = 0
    regex_chars: int = 0


# limit field -> (SchemaSize field, what it measures), in the order they are checked
_MEASURES = {
    "max_schema_depth": ("depth", "the schema's nesting depth (objects and arrays)"),
    "max_schema_nodes": ("nodes", "the schema's number of objects and arrays"),
    "max_schema_branches": ("branches", "the schema's number of anyOf/oneOf/allOf branches"),
    "max_schema_refs": ("refs", "the schema's number of $ref"),
    "max_regex_chars": ("regex_chars", "the longest regex's length"),
}


class SchemaLimitError(ValueError):
    """A structured output past one of ``SchemaLimits``; ``limit`` names the field."""

    def __init__(self, limit: str, value: int, allowed: int) -> None:
        _, what = _MEASURES[limit]
        flag = "--" + limit.replace("_", "-")
        super().__init__(f"{what} is {value}, over the limit of {allowed} ({limit}, {flag})")
        self.limit = limit
        self.value = value


def check_spec(spec: StructuredOutputs, limits: SchemaLimits) -> None:
    """SchemaLimitError if ``spec`` (a ``json`` schema or a ``regex``) is past a limit."""
    check_size(spec_size(spec), limits)


def check_size(size: SchemaSize, limits: SchemaLimits) -> None:
    """SchemaLimitError for the first limit ``size`` is over (depth first: it grows the build
    time fastest)."""
    for limit, (measure, _) in _MEASURES.items():
        value, allowed = getattr(size, measure), getattr(limits, limit)
        if value > allowed:
            raise SchemaLimitError(limit, value, allowed)


def spec_size(spec: StructuredOutputs) -> SchemaSize:
    """The size of ``spec``: its schema's (not JSON: empty, the build says why) or its regex's."""
    if spec.regex is not None:
        return SchemaSize(regex_chars=len(spec.regex))
    if spec.json is None:
        return SchemaSize()
    try:
        schema = json.loads(spec.json)
    except RecursionError:  # nested past what the parser takes: the text says how deep
        return SchemaSize(depth=text_depth(spec.json))
    except ValueError:
        return SchemaSize()
    return schema_size(schema)


def schema_size(schema: Any) -> SchemaSize:
    """The size of the JSON document ``schema`` (walked without recursion)."""
    depth = nodes = branches = refs = regex_chars = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in BRANCHING and isinstance(value, list):
                    branches += len(value)
                elif key == "$ref":
                    refs += 1
                elif key == "pattern" and isinstance(value, str):
                    regex_chars = max(regex_chars, len(value))
                elif key == "patternProperties" and isinstance(value, dict):
                    regex_chars = max(regex_chars, *map(len, value), 0)
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        nodes += 1
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return SchemaSize(depth, nodes, branches, refs, regex_chars)


def text_depth(text: str) -> int:
    """How deep objects and arrays nest in JSON ``text`` (brackets in strings skipped)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest
