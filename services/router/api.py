"""OpenAI request bodies -> a typed, validated ``GenerateRequest`` (pure, no I/O).

Three steps, each with its own kind of error:

1. refusals by name of what kvmesh cannot honour (``best_of``, ``echo``, ``functions``, batched prompts,
   non-text content parts) rather than ignoring them, and the served model;
2. the request Structs of ``request_bodies.py`` (the ones ``/openapi.json`` publishes) check
   every type and bound; msgspec's error becomes a 400 naming the parameter and quoting the
   value (``validation.py``);
3. what a schema cannot say: ``stream_options`` needs ``stream``, ``top_logprobs`` needs
   ``logprobs``, ``max_completion_tokens`` wins over ``max_tokens``, ``logit_bias`` keys are
   token ids, the "developer" role is the system prompt.

``kvmesh.services.router.prompt.tokenize`` then makes the request concrete.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import orjson
from kvmesh.services.router import structured
from kvmesh.services.router.errors import InvalidRequestError, ModelNotFoundError, quote_value
from kvmesh.services.router.refusals import (
    CHAT_UNSUPPORTED,
    COMPLETION_UNSUPPORTED,
    IGNORED_CHAT,
    IGNORED_COMPLETION,
    refuse_unknown,
    refuse_unsupported,
)
from kvmesh.services.router.request_bodies import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingFields,
)
from kvmesh.services.router.tools import forced_call, tool_use
from kvmesh.services.router.validation import validate_body
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputs
from kvmesh.shared.text.tool_prompt import ToolUse

Kind = Literal["completion", "chat"]
R = TypeVar("R", bound=SamplingFields)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One validated completion or chat request. Exactly one of ``prompt_text``,
    ``prompt_ids`` (completions) and ``messages`` (chat) is set."""

    kind: Kind
    model: str
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    tools: ToolUse | None = None  # chat: the tools, tool_choice and parallel_tool_calls
    max_tokens: int | None = None  # None: the default for the kind
    # how to sample; its max_tokens is set by prompt.tokenize, which knows the context
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    structured_param: str = ""  # the field that asked for sampling.structured_outputs
    echo: bool = False  # completions: the prompt leads each choice's text
    returns_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the answer
    stream: bool = False
    include_usage: bool = False
    prompt_cache_key: str = ""  # OpenAI's; salts the cache with sampling.cache_salt (tenants.py)


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
    refuse_unsupported(body, COMPLETION_UNSUPPORTED)
    refuse_unknown(body, CompletionRequest, COMPLETION_UNSUPPORTED, IGNORED_COMPLETION)
    spec, spec_param = structured.structured_outputs_of(body)
    body = {**_normalise(body), "prompt": _unwrap_prompt(body.get("prompt"))}
    req = _validate(body, CompletionRequest, served_model)
    is_text = isinstance(req.prompt, str)
    return GenerateRequest(
        kind="completion",
        prompt_text=req.prompt if is_text else None,
        prompt_ids=None if is_text else tuple(req.prompt),
        structured_param=spec_param,
        echo=req.echo,
        **_common(req, req.max_completion_tokens or req.max_tokens, req.logprobs, spec, req.echo),
    )


def parse_chat(body: Mapping[str, Any], served_model: str) -> GenerateRequest:
    """Validate a ``POST /v1/chat/completions`` body."""
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    refuse_unknown(body, ChatCompletionRequest, CHAT_UNSUPPORTED, IGNORED_CHAT)
    refuse_non_text_parts(body.get("messages"))
    spec, spec_param = structured.structured_outputs_of(body)
    req = _validate(_normalise(body), ChatCompletionRequest, served_model)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError(
            "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
        )
    tools = tool_use(req)
    if tools is not None and tools.is_forced:
        if spec is not None:
            raise InvalidRequestError(
                f"tool_choice {quote_value(body['tool_choice'])} holds the output to a tool "
                f"call; it cannot also follow '{spec_param}': send one of them",
                param="tool_choice",
                code="invalid_value",
            )
        spec, spec_param = forced_call(tools), "tools"
    return GenerateRequest(
        kind="chat",
        messages=chat_messages(req.messages),
        tools=tools,
        structured_param=spec_param,
        **_common(
            req,
            req.max_completion_tokens or req.max_tokens,
            (req.top_logprobs or 0) if req.logprobs else None,
            spec,
        ),
    )


def chat_messages(given: list[ChatMessage]) -> tuple[dict[str, Any], ...]:
    """Validated messages as the chat template takes them (tools: tool_prompt.chat_inputs)."""
    messages = []
    for i, message in enumerate(given):
        content = message.content
        if content is None and message.role != "assistant":
            raise InvalidRequestError(
                f"messages[{i}].content is required for a {message.role} message",
                param=f"messages[{i}].content",
                code="invalid_type",
            )
        if not isinstance(content, str):
            content = "".join(part.text for part in content or ())
        # Chat templates predate the "developer" role; it is the system prompt by another name.
        role = "system" if message.role == "developer" else message.role
        named = {"name": message.name} if message.name is not None else {}
        messages.append({"role": role, "content": content, **named, **_tool_parts(i, message)})
    return tuple(messages)


def _tool_parts(i: int, message: ChatMessage) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` (their arguments checked to be JSON objects) and a
    tool message's ``tool_call_id`` (required), as the template takes them."""
    where = f"messages[{i}]"
    if message.role == "tool":
        if not message.tool_call_id:
            raise InvalidRequestError(
                f"{where}.tool_call_id is required for a tool message: the id of the call it "
                "answers",
                param=f"{where}.tool_call_id",
                code="missing_required_parameter",
            )
        return {"tool_call_id": message.tool_call_id}
    owner = {"tool_call_id": "tool", "tool_calls": "assistant"}
    for name, role in owner.items():
        if getattr(message, name) is not None and message.role != role:
            raise InvalidRequestError(
                f"{where}.{name} is not taken on a {message.role} message (only on {role} ones)",
                param=f"{where}.{name}",
                code="invalid_value",
            )
    if not message.tool_calls:
        return {}
    for j, call in enumerate(message.tool_calls):
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            param = f"{where}.tool_calls[{j}].function.arguments"
            raise InvalidRequestError(
                f"{param} must be the JSON text of an object, got "
                f"{quote_value(call.function.arguments)}",
                param=param,
                code="invalid_value",
            )
    return {"tool_calls": [msgspec.to_builtins(call) for call in message.tool_calls]}


def _normalise(body: Mapping[str, Any]) -> dict[str, Any]:
    """What JSON cannot type as the schema wants: ``logit_bias`` keys are token ids written as
    strings (JSON object keys); they become integers here, or a 400 names the bad key."""
    bias = body.get("logit_bias")
    if not isinstance(bias, dict):
        return dict(body)
    ids = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise InvalidRequestError(
                f"'logit_bias' keys must be token ids (non-negative integers), got {quote_value(key)}",
                param="logit_bias",
                code="invalid_value",
            )
        ids[int(key)] = value
    return {**body, "logit_bias": ids}


def _common(
    req: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    spec: StructuredOutputs | None,
    echo: bool = False,
) -> dict[str, Any]:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequestError(
            "'prompt_logprobs' come with the whole answer, not a stream: send stream=false "
            "(or echo with logprobs, which streams the prompt's in the first chunk)",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    # the mesh scores the prompt for vLLM's prompt_logprobs and for an echo with logprobs
    asked = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(dict.fromkeys(req.stop or ()))
    sampling = req.sampling_options(
        logprobs=logprobs,
        prompt_logprobs=max(asked) if asked else None,
        structured_outputs=spec,
        stop=stop,
        top_k=max(req.top_k, 0),  # -1 (older vLLM clients) is off too
        cache_salt=req.cache_salt or "",
        max_tokens=max_tokens or 1,  # prompt.tokenize sets it against the context
    )
    return {
        "model": req.model,
        "returns_prompt_logprobs": req.prompt_logprobs is not None,
        "max_tokens": max_tokens,
        "sampling": sampling,
        "stream": req.stream,
        "include_usage": req.stream_options is not None and req.stream_options.include_usage,
        "prompt_cache_key": req.prompt_cache_key or "",
    }


# --- 1. refusals by name: refusals.py -----------------------------------------------------


def _unwrap_prompt(prompt: Any) -> Any:
    """OpenAI's prompt may be a list of prompts (a batch): one is accepted and unwrapped, more are
    refused. Unwrapped once, not recursively: deeper nesting is no prompt shape (and a recursion
    as deep as the JSON parser allows would overflow the stack)."""
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)):
        return prompt
    if len(prompt) > 1:
        raise InvalidRequestError(
            f"batched prompts are not supported (got {len(prompt)} prompts); send one prompt "
            "per request",
            param="prompt",
            code="unsupported_parameter",
        )
    (inner,) = prompt
    if isinstance(inner, list) and inner and not all(_is_int(t) for t in inner):
        raise InvalidRequestError(
            "'prompt' nests lists too deep: send a string, a list of token ids, or a list "
            "holding one of those",
            param="prompt",
            code="invalid_type",
        )
    return inner


def refuse_non_text_parts(messages: Any) -> None:
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") != "text":
                where = f"messages[{i}].content[{j}]"
                raise InvalidRequestError(
                    f"{where}: only text content parts are supported, got "
                    f"{quote_value(part.get('type'))}",
                    param=where,
                    code="unsupported_parameter",
                )


# --- 2. the schema -----------------------------------------------------------------------------


def _validate(body: Mapping[str, Any], cls: type[R], served_model: str) -> R:
    """``body`` as ``cls``; a null counts as absent (OpenAI clients send nulls for defaults)."""
    check_model(body.get("model"), served_model)
    return validate_body(body, cls)


def check_model(model: Any, served_model: str) -> None:
    if not isinstance(model, str) or not model:
        raise InvalidRequestError(
            f"'model' is required and must be a string; this router serves {served_model!r}",
            param="model",
            code="missing_required_parameter" if model is None else "invalid_type",
        )
    if model != served_model:
        raise ModelNotFoundError(
            f"the model {quote_value(model)} does not exist here; this router serves {served_model!r}",
            param="model",
        )


# --- quoting a client's value ------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
