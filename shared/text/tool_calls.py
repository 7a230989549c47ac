"""Tool calls in a model's output text, read as vLLM's ``--tool-call-parser`` reads them (pure).

Three formats:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them,
  with text around them (the text is the message's ``content``);
- ``llama3_json``: an output that starts with ``{`` (after Llama 3.1's ``<|python_tag|>``, if
  any) is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any other output is
  text;
- ``json``: what the grammar of a forced tool choice (``required``, a named function) writes: one
  ``{"name": ..., "arguments": {...}}`` object, or an array of them.

A call's ``arguments`` key may be ``parameters`` in every format. ``parse`` reads a whole output;
``ToolCallStream`` reads one as it grows and says what is new (text, a call's id and name, a
fragment of its arguments), so that the pieces of a stream add up to what ``parse`` answers. A
call's arguments are its JSON text as the model wrote it (an object; compact under a grammar).
A call that is not such an object (bad JSON, no name, arguments not an object) is text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Literal, get_args

ToolFormat = Literal["hermes", "llama3_json", "json"]
PARSERS: tuple[str, ...] = ("hermes", "llama3_json")  # --tool-call-parser's choices
assert set(PARSERS) < set(get_args(ToolFormat))

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# a call whose name comes first: its arguments can stream before the object closes
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SCALAR = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null")
_SPACE = re.compile(r"\s*")
_CONTROL = re.compile("[\x00-\x1f]")


def new_call_id() -> str:
    """An id as OpenAI writes them: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def default_parser(chat_template: str | None) -> str:
    """The parser a chat template's own tool format asks for: ``llama3_json`` for Llama 3.1's
    (``<|python_tag|>``, ``"parameters"``), else ``hermes`` (Qwen's, Hermes', and what kvmesh
    tells a model whose template has no tool format)."""
    text = chat_template or ""
    if HERMES_OPEN in text:
        return "hermes"
    if PYTHON_TAG in text or '"parameters"' in text:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # the JSON text of an object


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A finished output: its text (None when there is none but white space) and its calls."""

    content: str | None
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True, slots=True)
class CallDelta:
    """What a stream learnt of call ``index``: its id and name (the first delta of a call), then
    fragments of its arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class _PartialCall:
    name: str | None  # None: not known yet
    arguments: str  # the arguments' text so far
    is_complete: bool = False
    end: int = 0  # complete: the index past its object


@dataclass(slots=True)
class _Snapshot:
    content: str  # text known to be text (a possible opening tag at the end is held back)
    calls: list[_PartialCall] = field(default_factory=list)


def parse(text: str, fmt: ToolFormat) -> ParsedOutput:
    """The text and tool calls of a whole output."""
    snap = _snapshot(text, fmt, is_final=True)
    calls = tuple(ParsedCall(c.name, c.arguments) for c in snap.calls if c.name is not None)
    content = snap.content.rstrip()
    return ParsedOutput(content if content.strip() else None, calls)


class ToolCallStream:
    """One output read as it grows: ``add`` the new text, get what is new (text and
    ``CallDelta``s, in order); ``finish`` says the rest. White space at the end of the text is
    held until more text follows it (a finished output's trailing white space is dropped, as
    ``parse`` drops it)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self._num_content_sent = 0
        self._sent_calls: list[tuple[str, int]] = []  # (id, arguments characters sent)

    @property
    def num_calls(self) -> int:
        return len(self._sent_calls)

    def add(self, text: str) -> list[str | CallDelta]:
        self.text += text
        return self._deltas(is_final=False)

    def finish(self) -> list[str | CallDelta]:
        return self._deltas(is_final=True)

    def _deltas(self, is_final: bool) -> list[str | CallDelta]:
        snap = _snapshot(self.text, self.fmt, is_final)
        out: list[str | CallDelta] = []
        content = snap.content.rstrip()
        if len(content) > self._num_content_sent:
            out.append(content[self._num_content_sent :])
            self._num_content_sent = len(content)
        for index, call in enumerate(snap.calls):
            if call.name is None:
                break  # later calls cannot be known before this one's name
            if index == len(self._sent_calls):
                call_id = new_call_id()
                self._sent_calls.append((call_id, 0))
                out.append(CallDelta(index, id=call_id, name=call.name))
            call_id, num_sent = self._sent_calls[index]
            if len(call.arguments) > num_sent:
                out.append(CallDelta(index, arguments=call.arguments[num_sent:]))
                self._sent_calls[index] = (call_id, len(call.arguments))
        return out


# --- reading a (growing) output ---------------------------------------------------------------


def _snapshot(text: str, fmt: ToolFormat, is_final: bool) -> _Snapshot:
    if fmt == "hermes":
        return _hermes(text, is_final)
    start = _SPACE.match(text).end()  # type: ignore[union-attr]
    if fmt == "llama3_json":
        if text.startswith(PYTHON_TAG, start):
            start = _SPACE.match(text, start + len(PYTHON_TAG)).end()  # type: ignore[union-attr]
        elif not is_final and PYTHON_TAG.startswith(text[start:]):
            return _Snapshot("")  # may be the tag
    if start == len(text):
        return _Snapshot("" if not is_final else text)
    openers = "{[" if fmt == "json" else "{"
    if text[start] not in openers:
        return _Snapshot(text)
    calls = _json_calls(text, start, is_final, separator=";" if fmt == "llama3_json" else ",")
    return _Snapshot("", calls) if calls is not None else _Snapshot(text)


def _hermes(text: str, is_final: bool) -> _Snapshot:
    snap = _Snapshot("")
    pos = 0
    while True:
        begin = text.find(HERMES_OPEN, pos)
        if begin < 0:
            tail = text[pos:]
            if not is_final:  # hold back what may be the start of an opening tag
                tail = tail[: len(tail) - _tag_prefix_len(tail, HERMES_OPEN)]
            snap.content += tail
            return snap
        snap.content += text[pos:begin]
        inner = begin + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, inner)
        body_end = close if close >= 0 else len(text)
        is_closed = close >= 0 or is_final
        start = _SPACE.match(text, inner).end()  # type: ignore[union-attr]
        call = _call(text[:body_end], start, is_closed) if start < body_end else None
        if is_closed and (call is None or not call.is_complete or _rest(text, call, body_end)):
            # not a call: its text is text (an unclosed one only once the output is finished)
            snap.content += text[begin : close + len(HERMES_CLOSE) if close >= 0 else len(text)]
        elif call is not None:
            snap.calls.append(call)
        if close < 0:
            return snap
        pos = close + len(HERMES_CLOSE)


def _rest(text: str, call: _PartialCall, end: int) -> bool:
    """Whether anything but white space follows the object of ``call`` before ``end``."""
    return bool(text[call.end : end].strip())


def _tag_prefix_len(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` are the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _json_calls(text: str, start: int, is_final: bool, separator: str) -> list[_PartialCall] | None:
    """The calls of a ``{...}`` or ``[{...}, ...]`` (``json``) or ``{...}; {...}``
    (``llama3_json``) output from ``start``; None when it is no such output."""
    is_array = text[start] == "["
    pos = start + 1 if is_array else start
    if is_array:
        separator = ","
    calls: list[_PartialCall] = []
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos == len(text):
            return calls if not is_final else None
        if text[pos] != "{":
            return None
        call = _call(text, pos, is_final)
        if call is None:
            return None
        calls.append(call)
        if not call.is_complete:
            return calls if not is_final else None
        pos = _SPACE.match(text, call.end).end()  # type: ignore[union-attr]
        if pos == len(text):
            return calls if not is_array or not is_final else None
        if is_array and text[pos] == "]":
            after = text[pos + 1 :]
            return calls if not after.strip() else None
        if text[pos] != separator:
            return None
        pos += 1


def _call(text: str, start: int, is_final: bool) -> _PartialCall | None:
    """The call whose object starts at ``text[start]`` (``{``): complete once the object closes
    (then ``end`` is past it), partial with its name and the arguments so far when the name
    comes first; None when it is no call."""
    end = _value_end(text, start)
    head = _HEAD.match(text, start)
    if end is None:
        if is_final:
            return None
        if head is None:
            return _PartialCall(None, "")
        args_start = head.end()
        if args_start < len(text) and text[args_start] != "{":
            return _PartialCall(None, "")  # arguments that are no object: known only at the end
        args_end = _value_end(text, args_start) if args_start < len(text) else None
        name = _string(head[1])
        return (
            _PartialCall(name, _escape_controls(text[args_start : args_end or len(text)]))
            if name is not None
            else None
        )
    try:
        obj = json.loads(text[start:end], strict=False)  # raw control characters in strings
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    if not isinstance(obj.get(key), dict) or set(obj) - {"name", key}:
        return None
    if head is not None:
        args_end = _value_end(text, head.end())
        assert args_end is not None
        arguments = _escape_controls(text[head.end() : args_end])
    else:
        arguments = json.dumps(obj[key], ensure_ascii=False)
    return _PartialCall(obj["name"], arguments, is_complete=True, end=end)


def _string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"', strict=False)
    except ValueError:
        return None


def _escape_controls(text: str) -> str:
    """JSON text with the control characters in its strings escaped (``\\u001c``): a grammar
    lets a model write them raw, which strict JSON parsers refuse. Character by character, so
    that the escaped prefix of a text is the prefix of the escaped text."""
    if not _CONTROL.search(text):
        return text
    out, in_string, escaped = [], False, False
    for ch in text:
        if in_string and not escaped and ch < " ":
            out.append(f"\\u{ord(ch):04x}")
            continue
        out.append(ch)
        if in_string:
            in_string, escaped = _string_step(ch, escaped)
        elif ch == '"':
            in_string = True
    return "".join(out)


def _string_step(ch: str, escaped: bool) -> tuple[bool, bool]:
    """``ch`` read inside a JSON string (``escaped``: right after an unescaped backslash): whether
    the string goes on past it, and whether the next character is escaped."""
    if escaped:
        return True, False
    if ch == "\\":
        return True, True
    return ch != '"', False


def _value_end(text: str, start: int) -> int | None:
    """The index past the JSON value that starts at ``text[start]``; None when it goes on past
    the end of ``text`` (a number at the very end may go on)."""
    first = text[start]
    if first not in '{["':
        scalar = _SCALAR.match(text, start)
        return scalar.end() if scalar and scalar.end() < len(text) else None
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            in_string, escaped = _string_step(ch, escaped)
            if not in_string and depth == 0:
                return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
