"""OpenAI request bodies -> a typed, validated ``GenerateRequest`` (pure, no I/O).

``parse_completion`` and ``parse_chat`` check every parameter the router honours and refuse, by
name, the ones it cannot honour (``n`` > 1, ``logprobs``, penalties, tools ...) rather than ignore
them. ``kvmesh.services.router.prompt.tokenize`` then makes the request concrete.
"""

from __future__ import annotations

import reprlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from kvmesh.services.router.errors import InvalidRequestError, ModelNotFoundError

Kind = Literal["completion", "chat"]

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_QUOTE = reprlib.Repr()  # keyword arguments need Python 3.12
_QUOTE.maxlevel, _QUOTE.maxlist, _QUOTE.maxdict = 3, 8, 8
_QUOTE.maxstring = _QUOTE.maxother = _QUOTE.maxlong = 80


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One validated completion or chat request. Exactly one of ``prompt_text``,
    ``prompt_ids`` (completions) and ``messages`` (chat) is set."""

    kind: Kind
    model: str
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int | None = None  # None: the default for the kind
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON ({exc}); send a JSON object",
            code="invalid_json",
        ) from None
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    return body


def parse_completion(body: Mapping[str, Any], served_model: str) -> GenerateRequest:
    """Validate a ``POST /v1/completions`` body."""
    _refuse_unsupported(body, _COMPLETION_UNSUPPORTED)
    prompt_text, prompt_ids = _parse_prompt(body.get("prompt"))
    return GenerateRequest(
        kind="completion",
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        max_tokens=_max_tokens(body),
        **_common(body, served_model),
    )


def parse_chat(body: Mapping[str, Any], served_model: str) -> GenerateRequest:
    """Validate a ``POST /v1/chat/completions`` body."""
    _refuse_unsupported(body, _CHAT_UNSUPPORTED)
    return GenerateRequest(
        kind="chat",
        messages=_parse_messages(body.get("messages")),
        max_tokens=_max_tokens(body),
        **_common(body, served_model),
    )


def _max_tokens(body: Mapping[str, Any]) -> int | None:
    """``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens`` on both routes."""
    max_tokens = _opt_int(body, "max_completion_tokens", minimum=1)
    return max_tokens if max_tokens is not None else _opt_int(body, "max_tokens", minimum=1)


# --- parameters shared by both endpoints -------------------------------------------------------

# name -> (is the value harmless?, what to tell the user)
_COMMON_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "only n=1 is supported; send one request per completion"),
    "presence_penalty": (lambda v: v in (None, 0, 0.0), "presence_penalty is not supported"),
    "frequency_penalty": (lambda v: v in (None, 0, 0.0), "frequency_penalty is not supported"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported"),
    # vLLM's extra sampling parameters: accepted at their neutral value, refused otherwise
    "min_tokens": (lambda v: v in (None, 0), "min_tokens is not supported"),
    "repetition_penalty": (lambda v: v in (None, 1, 1.0), "repetition_penalty is not supported"),
    "min_p": (lambda v: v in (None, 0, 0.0), "min_p is not supported"),
    "stop_token_ids": (lambda v: not v, "stop_token_ids is not supported; use stop strings"),
    "include_stop_str_in_output": (
        lambda v: v in (None, False),
        "include_stop_str_in_output is not supported (stop strings are cut from the output)",
    ),
}
_COMPLETION_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "echo": (lambda v: v in (None, False), "echo is not supported"),
    "logprobs": (lambda v: v is None, "logprobs are not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
}
_CHAT_UNSUPPORTED = {
    **_COMMON_UNSUPPORTED,
    "logprobs": (lambda v: v in (None, False), "logprobs are not supported"),
    "top_logprobs": (lambda v: v in (None, 0), "top_logprobs are not supported"),
    "tools": (lambda v: not v, "tools (function calling) are not supported"),
    "functions": (lambda v: not v, "functions (function calling) are not supported"),
    "response_format": (
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        "only response_format {'type': 'text'} is supported",
    ),
}


def _refuse_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, str]]) -> None:
    for name, (is_harmless, message) in table.items():
        if name in body and not is_harmless(body[name]):
            raise InvalidRequestError(
                f"{message} (got {name}={_show(body[name])})",
                param=name,
                code="unsupported_parameter",
            )


def _common(body: Mapping[str, Any], served_model: str) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(
            f"'model' is required and must be a string; this router serves {served_model!r}",
            param="model",
            code="missing_required_parameter" if model is None else "invalid_type",
        )
    if model != served_model:
        raise ModelNotFoundError(
            f"the model {_show(model)} does not exist here; this router serves {served_model!r}",
            param="model",
        )
    top_k = _opt_int(body, "top_k", minimum=-1)
    stream = _opt_bool(body, "stream")
    return {
        "model": model,
        "temperature": _opt_number(body, "temperature", 0.0, 2.0, default=1.0),
        "top_p": _opt_number(body, "top_p", 0.0, 1.0, default=1.0, exclusive_min=True),
        "top_k": -1 if top_k in (None, 0) else top_k,
        "seed": _opt_int(body, "seed", minimum=-MAX_SEED, maximum=MAX_SEED),
        "stop": _parse_stop(body.get("stop")),
        "ignore_eos": _opt_bool(body, "ignore_eos"),
        "stream": stream,
        "include_usage": _parse_stream_options(body.get("stream_options"), stream),
    }


def _parse_prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    # OpenAI's shapes: a string, token ids, or a list of those (a batch; one is accepted).
    # Unwrapped once, not recursively: deeper nesting is no prompt shape (and a recursion as
    # deep as the JSON parser allows would overflow the stack).
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > 1:
            raise InvalidRequestError(
                f"batched prompts are not supported (got {len(prompt)} prompts); send one "
                "prompt per request",
                param="prompt",
                code="unsupported_parameter",
            )
        (prompt,) = prompt
        if isinstance(prompt, list) and prompt and not all(_is_int(t) for t in prompt):
            raise InvalidRequestError(
                "'prompt' nests lists too deep: send a string, a list of token ids, or a list "
                "holding one of those",
                param="prompt",
                code="invalid_type",
            )
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise InvalidRequestError("prompt token ids must be >= 0", param="prompt")
        return None, tuple(prompt)
    if prompt is None:
        raise InvalidRequestError(
            "'prompt' is required: a string or a list of token ids",
            param="prompt",
            code="missing_required_parameter",
        )
    raise InvalidRequestError(
        f"'prompt' must be a non-empty string or list of token ids, got {_describe(prompt)}",
        param="prompt",
        code="invalid_type",
    )


def _parse_messages(messages: Any) -> tuple[dict[str, str], ...]:
    if messages is None:
        raise InvalidRequestError(
            "'messages' is required: a list of {role, content} objects",
            param="messages",
            code="missing_required_parameter",
        )
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            f"'messages' must be a non-empty list, got {_describe(messages)}",
            param="messages",
            code="invalid_type",
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"{where} must be an object, got {_describe(message)}", param=where
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}",
                param=f"{where}.role",
            )
        content = _message_content(message.get("content"), f"{where}.content", role)
        # Chat templates predate the "developer" role; it is the system prompt by another name.
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _message_content(content: Any, where: str, role: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else _describe(part)
                raise InvalidRequestError(
                    f"{where}[{j}]: only text content parts are supported, got {_show(kind)}",
                    param=f"{where}[{j}]",
                    code="unsupported_parameter",
                )
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"{where}[{j}].text must be a string", param=where)
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"{where} must be a string or a list of text parts, got {_describe(content)}",
        param=where,
        code="invalid_type",
    )


def _parse_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items: Sequence[Any] = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise InvalidRequestError(
            f"'stop' must be a non-empty string or a list of non-empty strings, got {_show(stop)}",
            param="stop",
        )
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
        )
    return tuple(dict.fromkeys(items))


def _parse_stream_options(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise InvalidRequestError(
            f"'stream_options' must be an object, got {_describe(options)}",
            param="stream_options",
        )
    if not stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequestError(
            f"'stream_options.include_usage' must be a boolean, got {_show(include)}",
            param="stream_options.include_usage",
        )
    return include


def _opt_int(
    body: Mapping[str, Any], name: str, *, minimum: int, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise InvalidRequestError(
            f"'{name}' must be an integer, got {_show(value)}", param=name, code="invalid_type"
        )
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise InvalidRequestError(f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _opt_number(
    body: Mapping[str, Any],
    name: str,
    low: float,
    high: float,
    *,
    default: float,
    exclusive_min: bool = False,
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(
            f"'{name}' must be a number, got {_show(value)}", param=name, code="invalid_type"
        )
    too_low = value <= low if exclusive_min else value < low
    if too_low or value > high:
        bracket = "(" if exclusive_min else "["
        raise InvalidRequestError(
            f"'{name}' must be in {bracket}{low:g}, {high:g}], got {value}", param=name
        )
    return float(value)


def _opt_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequestError(
            f"'{name}' must be a boolean, got {_show(value)}", param=name, code="invalid_type"
        )
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A client's value quoted in an error message: its repr, cut short in length and depth
    (a plain repr of a value nested as deep as the JSON parser allows overflows the stack)."""
    return _QUOTE.repr(value)


def _describe(value: Any) -> str:
    if isinstance(value, list) and not value:
        return "an empty list"
    return type(value).__name__ if value is not None else "null"
