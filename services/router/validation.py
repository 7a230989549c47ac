"""A parsed body as its request Struct (request_bodies.py), with msgspec's errors worded as
OpenAI-style 400s (pure).

msgspec says ``Expected `float` <= 2.0 - at `$.temperature```; the client is told which
parameter (``temperature``, ``messages[0].role``) must be what (``a number in [0, 2]``, in words
derived from the schema, or a field's ``Meta(extra={"expects": ...})``) and the value it sent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi
from kvmesh.services.router.errors import InvalidRequestError, quote_value

S = TypeVar("S", bound=msgspec.Struct)


def validate_body(body: Mapping[str, Any], cls: type[S]) -> S:
    """``body`` as ``cls`` (fields it does not take are dropped: refuse them first); a null
    counts as absent; msgspec's error becomes a 400 naming the parameter."""
    present = {
        k: v
        for k, v in body.items()
        if v is not None and k in cls.__struct_fields__ and k != "structured_outputs"
    }
    try:
        return msgspec.convert(present, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise _schema_error(cls, present, str(exc)) from None


_ERROR = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]")


def _schema_error(cls: type, body: Mapping[str, Any], error: str) -> InvalidRequestError:
    """msgspec's ``Expected `float` <= 2.0 - at `$.temperature``` as an OpenAI 400 naming the
    parameter (``temperature``, ``messages[0].role``; an index into a list of plain values
    names the list) and saying what it takes, in words derived from the schema."""
    parts = _ERROR.match(error)
    assert parts is not None
    path: list[str | int] = [
        name or int(index) for name, index in _PATH_PART.findall(parts["path"] or "")
    ]
    missing = _MISSING.match(parts["what"])
    if missing:
        path.append(missing["name"])
    node, value, shown = mi.type_info(cls), body, []
    for step in path:
        child = _child(node, step)
        if child is None:  # past the last object: the error names the enclosing parameter
            break
        node, value = child, value[step] if not missing or step != path[-1] else None
        shown.append(f"[{step}]" if isinstance(step, int) else f".{step}")
    param = "".join(shown).lstrip(".")
    expects = _expects(node)
    if missing:
        return InvalidRequestError(
            f"'{param}' is required: {expects}", param=param, code="missing_required_parameter"
        )
    what = parts["what"]
    is_type = what.startswith("Expected `") and ", got `" in what
    inner = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path[len(shown) :])
    detail = f" ({param}{inner}: {what[:1].lower()}{what[1:]})".replace("`", "") if inner else ""
    return InvalidRequestError(
        f"'{param}' must be {expects}, got {quote_value(value)}{detail}",
        param=param,
        code="invalid_type" if is_type else "invalid_value",
    )


def _child(node: mi.Type, step: str | int) -> mi.Type | None:
    """The type one step below ``node``: a field of an object, or an object in a list (None
    for an item of a list of plain values, which is no parameter of its own)."""
    node = _bare(node)
    options = node.types if isinstance(node, mi.UnionType) else (node,)
    for option in map(_bare, options):
        if isinstance(step, str) and isinstance(option, mi.StructType):
            return next((f.type for f in option.fields if f.encode_name == step), None)
        if isinstance(step, int) and isinstance(option, mi.ListType):
            item = _bare(option.item_type)
            return option.item_type if isinstance(item, mi.StructType) else None
    return None


def _bare(node: mi.Type) -> mi.Type:
    return node.type if isinstance(node, mi.Metadata) else node


def _expects(node: mi.Type) -> str:
    """What a value of ``node`` must be, in words: "a number in [0, 2]"."""
    if isinstance(node, mi.Metadata):
        if node.extra and "expects" in node.extra:
            return node.extra["expects"]
        node = node.type
    if isinstance(node, mi.UnionType):
        return " or ".join(_expects(t) for t in node.types if not isinstance(t, mi.NoneType))
    if isinstance(node, mi.BoolType):
        return "a boolean"
    if isinstance(node, mi.IntType | mi.FloatType):
        noun = "an integer" if isinstance(node, mi.IntType) else "a number"
        return f"{noun}{_bounds(node)}"
    if isinstance(node, mi.StrType):
        return "a non-empty string" if node.min_length else "a string"
    if isinstance(node, mi.LiteralType):
        return "one of " + ", ".join(map(str, node.values))
    if isinstance(node, mi.ListType):
        size = f" of at most {node.max_length}" if node.max_length is not None else ""
        return f"{'a non-empty' if node.min_length else 'a'} list{size}"
    if isinstance(node, mi.StructType):
        return "an object"
    return "something else"


def _bounds(node: mi.IntType | mi.FloatType) -> str:
    low, bracket = (node.gt, "(") if node.gt is not None else (node.ge, "[")
    if node.le is None:
        return "" if low is None else f" {'>' if bracket == '(' else '>='} {_num(low)}"
    if low is None:
        return f" <= {_num(node.le)}"
    return f" in {bracket}{_num(low)}, {_num(node.le)}]"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"
