"""Tools in a chat prompt, and the grammar of a forced tool choice (pure).

``ToolUse`` is what a chat request says about tools: the functions, ``tool_choice`` and
``parallel_tool_calls``. ``chat_inputs`` turns the messages and the tools into what the model's
chat template renders. A template that knows tools (it reads ``tools``) gets them, and the
assistant messages' ``tool_calls`` with their arguments as objects, as transformers gives them.
A template that does not (SmolLM2's, kvmesh-tiny's) gets them written as text, the way
Hermes-style models are prompted: the functions and how to call them in the system message,
earlier calls in the assistant's text, tool results as ``<tool_response>`` user turns.

``forced_schema`` is the JSON schema a ``required`` or named tool choice holds the output to:
``{"name": ..., "arguments": {...the function's parameters...}}``, or an array of one or more
of those when ``required`` allows parallel calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.shared.text.tool_calls import HERMES_CLOSE, HERMES_OPEN, ToolFormat

Choice = Literal["none", "auto", "required", "function"]
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The tools of a chat request. ``functions``: each ``{"name", "description"?,
    "parameters"?}``; ``choice`` "function" forces ``function_name``."""

    functions: tuple[Mapping[str, Any], ...]
    choice: Choice = "auto"
    function_name: str | None = None
    is_parallel: bool = True

    def __post_init__(self) -> None:
        assert (self.choice == "function") == (self.function_name is not None), self
        assert self.functions or self.choice == "none", self

    @property
    def is_forced(self) -> bool:
        return self.choice in ("required", "function")

    def output_format(self, parser: str) -> ToolFormat | None:
        """How the output's calls are read: None (``none``: the output is text), ``json`` (a
        forced choice: the grammar writes bare JSON), else the router's ``parser``."""
        if self.choice == "none":
            return None
        return "json" if self.is_forced else parser  # type: ignore[return-value]

    def forced_schema(self) -> dict[str, Any]:
        """The JSON schema of a forced choice's output."""
        assert self.is_forced
        if self.choice == "function":
            (fn,) = [f for f in self.functions if f["name"] == self.function_name]
            return _call_schema(fn)
        one = {"anyOf": [_call_schema(fn) for fn in self.functions]}
        if len(self.functions) == 1:
            one = _call_schema(self.functions[0])
        if not self.is_parallel:
            return one
        return {"type": "array", "items": one, "minItems": 1}


def _call_schema(fn: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": fn["name"]},
            "arguments": fn.get("parameters") or NO_PARAMETERS,
        },
        "required": ["name", "arguments"],
    }


def knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return chat_template is not None and "tools" in chat_template


def chat_inputs(
    messages: Sequence[Mapping[str, Any]],
    tools: ToolUse | None,
    chat_template: str | None,
    fmt: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and the extra context (``tools``) to render ``messages`` and ``tools`` with
    ``chat_template``; ``fmt`` (``hermes``, ``llama3_json``) is how a template without tools is
    told to write calls. A ``none`` choice shows the model no tools."""
    shown = tools if tools is not None and tools.choice != "none" else None
    if knows_tools(chat_template):
        context = {}
        if shown is not None:
            context["tools"] = [{"type": "function", "function": dict(f)} for f in shown.functions]
        return [_with_argument_objects(m) for m in messages], context
    out = [_as_text(m, fmt) for m in messages]
    if shown is not None:
        note = instructions(shown.functions, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{note}"}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, {}


def instructions(functions: Sequence[Mapping[str, Any]], fmt: str) -> str:
    """The system prompt that offers ``functions`` to a model whose template has no tools: the
    Hermes function-calling prompt, or Llama 3.1's JSON one for ``llama3_json``."""
    specs = "\n".join(json.dumps({"type": "function", "function": dict(f)}) for f in functions)
    if fmt == "llama3_json":
        return (
            "Given the following functions, please respond with a JSON for a function call "
            "with its proper arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of '
            "argument name and its value}. Do not use variables.\n\n" + specs
        )
    return (
        "You are a function calling AI model. You are provided with function signatures "
        "within <tools></tools> XML tags. You may call one or more functions to assist with "
        "the user query. Don't make assumptions about what values to plug into functions. "
        f"Here are the available tools: <tools>\n{specs}\n</tools>\n"
        "For each function call, return a json object with function name and arguments within "
        f"{HERMES_OPEN}{HERMES_CLOSE} XML tags as follows:\n"
        f'{HERMES_OPEN}\n{{"name": <function-name>, "arguments": <args-dict>}}\n{HERMES_CLOSE}'
    )


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant message's calls with their arguments as objects (templates index them)."""
    if not message.get("tool_calls"):
        return dict(message)
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def _as_text(message: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """A message as a template without tools takes it: role and text (and name)."""
    plain = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return plain
    written = [
        {"name": c["function"]["name"], _key(fmt): json.loads(c["function"]["arguments"])}
        for c in calls
    ]
    if fmt == "llama3_json":
        text = "; ".join(json.dumps(w) for w in written)
    else:
        text = "\n".join(f"{HERMES_OPEN}\n{json.dumps(w)}\n{HERMES_CLOSE}" for w in written)
    content = plain.get("content") or ""
    return {**plain, "content": f"{content}\n{text}" if content else text}


def _key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"
