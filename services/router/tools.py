"""A chat request's tools, checked (pure, but ``check_tools``): ``tool_use`` makes the body's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` one ``ToolUse`` (shared/text/tool_prompt.py)
or a 400 naming what is wrong; ``forced_call`` is the structured output of a forced choice;
``check_tools`` holds each function's parameters schema to the router's schema limits and
builds it, as a ``response_format`` schema is (structured.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
from kvmesh.services.router import structured
from kvmesh.services.router.errors import InvalidRequestError, quote_value
from kvmesh.services.router.request_bodies import ChatCompletionRequest, FunctionDefinition
from kvmesh.shared.text.schema_limits import SchemaLimits
from kvmesh.shared.text.structured_output import (
    StructuredOutputError,
    StructuredOutputs,
    json_schema_text,
)
from kvmesh.shared.text.tool_prompt import ToolUse


def tool_use(req: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools as a ``ToolUse`` (None: no tools); a ``tool_choice`` that names no
    given function, or forces a call without tools, is a 400 naming it."""
    choice = req.tool_choice
    names = [tool.function.name for tool in req.tools or ()]
    if not names:
        if choice is None or choice in ("none", "auto"):
            return None
        shown = choice if isinstance(choice, str) else f"naming {choice.function.name!r}"
        raise InvalidRequestError(
            f"tool_choice {shown} needs tools: send the functions in 'tools'",
            param="tool_choice",
            code="invalid_value",
        )
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise InvalidRequestError(
            f"'tools' names the function {twice!r} twice; function names must be unique",
            param="tools",
            code="invalid_value",
        )
    for i, tool in enumerate(req.tools or ()):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object":
            param = f"tools[{i}].function.parameters"
            raise InvalidRequestError(
                f"{param} must be the JSON schema of an object (arguments are an object), got "
                f"type {quote_value(kind)}",
                param=param,
                code="invalid_value",
            )
    functions = tuple(_function(tool.function) for tool in req.tools or ())
    if choice is None or isinstance(choice, str):
        return ToolUse(functions, choice or "auto", is_parallel=req.parallel_tool_calls)
    name = choice.function.name
    if name not in names:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(map(repr, names))})",
            param="tool_choice",
            code="invalid_value",
        )
    return ToolUse(functions, "function", name, is_parallel=req.parallel_tool_calls)


def _function(definition: FunctionDefinition) -> dict[str, Any]:
    """A function as templates take it: name, and description and parameters when given."""
    given = msgspec.to_builtins(definition)
    return {k: given[k] for k in ("name", "description", "parameters") if given[k] is not None}


def forced_call(tools: ToolUse) -> StructuredOutputs:
    """The structured output that holds a forced choice's output to a call."""
    try:
        return StructuredOutputs(json=json_schema_text(tools.forced_schema()))
    except StructuredOutputError as exc:
        raise InvalidRequestError(f"'tools': {exc}", param="tools", code="invalid_value") from None


def check_tools(tools: ToolUse, limits: SchemaLimits) -> None:
    """Each function's parameters schema within ``limits`` and building a grammar, whatever
    the tool_choice (a 400 naming the function's parameters); slow the first time (xgrammar's
    import): call it off the event loop."""
    for i, function in enumerate(tools.functions):
        if "parameters" not in function:
            continue
        param = f"tools[{i}].function.parameters"
        try:
            spec = StructuredOutputs(json=json_schema_text(function["parameters"]))
        except StructuredOutputError as exc:
            raise InvalidRequestError(
                f"'{param}': {exc}", param=param, code="invalid_value"
            ) from None
        structured.check(spec, param, limits)
