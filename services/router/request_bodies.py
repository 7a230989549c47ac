"""The router's HTTP request bodies, each defined once as a msgspec Struct.

``api.py`` converts a parsed body into them (``validation.py`` words msgspec's errors as
OpenAI-style 400s), and ``openapi.py`` publishes their JSON Schema, so the document at
``/openapi.json`` cannot drift from the code. The answers are response_bodies.py's.

A field's ``Meta(extra={"expects": ...})`` is how an error message describes what it takes when
its type alone would say it badly.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

import msgspec
from kvmesh.shared.text.sampling import (
    MAX_CACHE_SALT,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    NonEmptyStr,
    SamplingOptions,
    TokenId,
)
from msgspec import Meta

Role = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES = get_args(Role)
MAX_TOOLS = 128
# OpenAI's function names: letters, digits, underscores and dashes (dots too, as vLLM takes)
FunctionName = Annotated[
    str,
    Meta(
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        extra={"expects": "a name of 1-64 letters, digits, '_', '.' or '-'"},
    ),
]


class StreamOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    include_usage: bool = False


class TextPart(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


class FunctionCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    arguments: Annotated[str, Meta(description="The arguments, as the JSON text of an object")]


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A call of a function: in an assistant message sent back, and in an answer."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionDefinition(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: (
        Annotated[
            dict[str, Any],
            Meta(description="A JSON schema of the arguments (an object); absent: none"),
        ]
        | None
    ) = None
    strict: bool | None = None


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``tool_choice`` forcing one function."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Role
    content: Annotated[
        str | list[TextPart] | None,
        Meta(
            description="Text, or text parts joined in order; null only for an assistant message",
            extra={"expects": "a string or a list of text parts"},
        ),
    ] = None
    name: (
        Annotated[str, Meta(description="The author's name, given to the chat template")] | None
    ) = None
    tool_calls: (
        Annotated[list[ToolCall], Meta(description="An assistant message's calls")] | None
    ) = None
    tool_call_id: (
        Annotated[str, Meta(description="A tool message's: the call it answers")] | None
    ) = None


class SamplingFields(SamplingOptions, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The parameters both generate routes take: every sampling option (``SamplingOptions``,
    its fields, bounds and descriptions) and the request's own. Any other field is refused by
    name before this schema applies (``api.py``), but for a few that are harmless to ignore
    (docs/openai_api.md). ``max_tokens`` and the HTTP shapes of ``stop`` and ``top_k`` are the
    API's own: ``api.py`` maps them onto the options."""

    model: Annotated[NonEmptyStr, Meta(description="Must be the served model (GET /v1/models).")]
    top_k: Annotated[int, Meta(ge=-1, description="0 (or -1, as older vLLM clients send): off")] = 0
    stop: (
        NonEmptyStr
        | Annotated[
            list[NonEmptyStr],
            Meta(
                max_length=MAX_STOP_STRINGS,
                extra={"expects": f"a list of at most {MAX_STOP_STRINGS} non-empty strings"},
            ),
        ]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: (
        Annotated[
            str,
            Meta(
                max_length=MAX_CACHE_SALT,
                description="vLLM's: requests share cached prompt blocks only with requests of "
                "the same salt",
            ),
        ]
        | None
    ) = None
    prompt_cache_key: (
        Annotated[
            str,
            Meta(
                max_length=MAX_CACHE_SALT,
                description="OpenAI's: requests share cached prompt blocks only with requests "
                "of the same key (it salts them, with cache_salt)",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        pass  # decoded from a body: msgspec has checked every field

    def sampling_options(self, **api_fields: Any) -> SamplingOptions:
        """The options this body asks for: its ``SamplingOptions`` fields, with ``api_fields``
        (the options whose HTTP shape differs, mapped by ``api.py``) over them, checked against
        ``SamplingOptions``' own types and bounds."""
        shared = {name: getattr(self, name) for name in SamplingOptions.__struct_fields__}
        return msgspec.convert(shared | api_fields, SamplingOptions)


class CompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """``POST /v1/completions``."""

    prompt: Annotated[
        str | Annotated[list[TokenId], Meta(min_length=1)],
        Meta(
            description="Text or token ids. A list holding one of those is accepted too; more "
            "than one (a batch) is refused.",
            extra={"expects": "a string or a non-empty list of token ids"},
        ),
    ]
    max_tokens: Annotated[int, Meta(ge=1, description="Default 16")] | None = None
    # OpenAI's newer name, taken on both routes; it wins over max_tokens
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    echo: Annotated[
        bool, Meta(description="The prompt leads the text (and, with logprobs, the logprobs)")
    ] = False


class ChatCompletionRequest(SamplingFields, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``."""

    logprobs: Annotated[bool, Meta(description="Return the output tokens' log-probabilities")] = (
        False
    )
    top_logprobs: (
        Annotated[
            int,
            Meta(ge=0, le=MAX_LOGPROBS, description="With logprobs: this many likeliest tokens"),
        ]
        | None
    ) = None

    messages: Annotated[
        list[ChatMessage],
        Meta(min_length=1, extra={"expects": "a non-empty list of {role, content} objects"}),
    ]
    max_completion_tokens: (
        Annotated[int, Meta(ge=1, description="Default: what the context has left")] | None
    ) = None
    max_tokens: (
        Annotated[int, Meta(ge=1, description="Deprecated: max_completion_tokens")] | None
    ) = None
    tools: (
        Annotated[
            list[Tool],
            Meta(
                max_length=MAX_TOOLS,
                description="Functions the model may call",
                extra={"expects": f"a list of at most {MAX_TOOLS} function tools"},
            ),
        ]
        | None
    ) = None
    tool_choice: (
        Annotated[
            Literal["none", "auto", "required"] | NamedToolChoice,
            Meta(
                description="none, auto (the default with tools), required (at least one call) "
                "or a function to call",
                extra={
                    "expects": "'none', 'auto', 'required' or "
                    "{'type': 'function', 'function': {'name': ...}}"
                },
            ),
        ]
        | None
    ) = None
    parallel_tool_calls: Annotated[
        bool, Meta(description="Whether the model may call several functions at once")
    ] = True


class TokenizeCompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize`` of a text prompt (vLLM's)."""

    model: NonEmptyStr | None = None  # if given, the served model
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Annotated[bool, Meta(description="Also return each token's text")] = False


class TokenizeChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize`` of chat messages through the chat template (vLLM's)."""

    model: NonEmptyStr | None = None
    messages: Annotated[
        list[ChatMessage],
        Meta(min_length=1, extra={"expects": "a non-empty list of {role, content} objects"}),
    ]
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /detokenize`` (vLLM's)."""

    model: NonEmptyStr | None = None
    tokens: list[TokenId]


REQUESTS = (
    CompletionRequest,
    ChatCompletionRequest,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
