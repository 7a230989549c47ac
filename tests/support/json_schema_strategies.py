"""Hypothesis strategies for the JSON Schema subset the router's OpenAPI document uses.

``from_schema`` draws instances of a schema: ``type`` (null, boolean, integer, number, string,
array, object), ``anyOf``, ``enum``, ``const``, numeric bounds (``minimum``, ``maximum``,
``exclusiveMinimum``), ``minLength``, ``maxLength``, ``pattern``, ``minItems``/``maxItems``,
``properties``/``required`` (``additionalProperties: false`` draws none beyond them), maps
(``additionalProperties`` a schema, ``propertyNames``, ``maxProperties``). A
keyword outside that subset raises, so a schema that grows past it fails loudly instead of being
half-generated. ``inline_refs`` replaces ``#/...`` references by what they point to.

(hypothesis-jsonschema would do this, but it reaches into hypothesis internals that recent
hypothesis releases changed; this subset is small enough to own.)
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

# keywords that describe a schema without constraining its instances
_ANNOTATIONS = {"description", "default", "deprecated", "title"}
_KNOWN = _ANNOTATIONS | {
    "type",
    "anyOf",
    "enum",
    "const",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "minLength",
    "maxLength",
    "pattern",
    "items",
    "minItems",
    "maxItems",
    "properties",
    "required",
    "additionalProperties",
    "propertyNames",
    "maxProperties",
}
MAX_STRING = 40
MAX_ITEMS = 6


def inline_refs(node: Any, document: dict) -> Any:
    """``node`` with every ``#/...`` $ref replaced by its target (no recursive schemas)."""
    if isinstance(node, list):
        return [inline_refs(item, document) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return inline_refs(target, document)
    return {key: inline_refs(value, document) for key, value in node.items()}


def from_schema(schema: dict) -> st.SearchStrategy[Any]:
    """Instances of ``schema`` (refs already inlined)."""
    unknown = set(schema) - _KNOWN
    if unknown:
        raise ValueError(f"from_schema does not support {sorted(unknown)} (in {schema})")
    if "anyOf" in schema:
        return st.one_of(*(from_schema(option) for option in schema["anyOf"]))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return _numbers(schema)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        max_size = min(schema.get("maxLength", MAX_STRING), MAX_STRING)
        return st.text(min_size=schema.get("minLength", 0), max_size=max_size)
    if kind == "array":
        min_items = schema.get("minItems", 0)
        max_items = schema.get("maxItems", max(min_items, MAX_ITEMS))
        return st.lists(
            from_schema(schema.get("items", {})), min_size=min_items, max_size=max_items
        )
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):  # a map
        keys = from_schema({"type": "string", **schema.get("propertyNames", {})})
        max_size = min(schema.get("maxProperties", MAX_ITEMS), MAX_ITEMS)
        values = from_schema(schema["additionalProperties"])
        return st.dictionaries(keys, values, max_size=max_size)
    if kind == "object":
        properties = {name: from_schema(sub) for name, sub in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {name: s for name, s in properties.items() if name in required},
            optional={name: s for name, s in properties.items() if name not in required},
        )
    raise ValueError(f"from_schema needs a type, anyOf, enum or const (in {schema})")


def _numbers(schema: dict) -> st.SearchStrategy[float | int]:
    exclusive = "exclusiveMinimum" in schema
    low = schema["exclusiveMinimum"] if exclusive else schema.get("minimum")
    high = schema.get("maximum")
    floats = st.floats(low, high, exclude_min=exclusive, allow_nan=False, allow_infinity=False)
    int_low = None if low is None else math.floor(low) + 1 if exclusive else math.ceil(low)
    int_high = None if high is None else math.floor(high)
    if int_low is not None and int_high is not None and int_low > int_high:
        return floats
    return floats | st.integers(int_low, int_high)  # JSON numbers: 1 is as much one as 1.0
