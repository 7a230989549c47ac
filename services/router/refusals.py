"""What the router refuses by name, and the few fields it may ignore (pure).

Every field a body's Struct does not take is a 400 naming it (``refuse_unknown``): an ignored
field makes the client believe it was honoured. The exceptions are fields that change nothing
at the values listed (``IGNORED_*``; docs/openai_api.md), and fields with a message of their own
(``*_UNSUPPORTED``: refused unless at a value that means "off").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvmesh.services.router import structured
from kvmesh.services.router.errors import InvalidRequestError, quote_value

# name -> (is the value harmless?, what to tell the user)
COMMON_UNSUPPORTED: dict[str, tuple[Any, str]] = {}
COMPLETION_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "best_of": (lambda v: v in (None, 1), "only best_of=1 is supported"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
}
CHAT_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "functions": (
        lambda v: not v,
        "the deprecated functions are not supported: send them as tools (function calling)",
    ),
}


# Fields kvmesh does not take but may ignore without changing the answer, each at the values
# for which that is true (docs/openai_api.md lists them); any other field is refused by name.
IGNORED_COMMON: dict[str, Any] = {
    "user": lambda v: True,  # an end-user id for the provider's abuse monitoring
    "metadata": lambda v: True,  # tags for OpenAI's stored completions
    "store": lambda v: v is False,  # nothing is stored: store=true is refused
    "service_tier": lambda v: v in ("auto", "default"),
    "safety_identifier": lambda v: True,
    "skip_special_tokens": lambda v: v is True,  # what the router does
    "spaces_between_special_tokens": lambda v: v is True,
    "priority": lambda v: v == 0,
    "guided_decoding_backend": lambda v: v in ("xgrammar", "auto"),  # the one kvmesh has
}
IGNORED_COMPLETION = {
    **IGNORED_COMMON,
    "add_special_tokens": lambda v: v is True,  # a text prompt is encoded with them
}
IGNORED_CHAT = {
    **IGNORED_COMMON,
    "echo": lambda v: v is False,
    "add_generation_prompt": lambda v: v is True,
    "continue_final_message": lambda v: v is False,
    "add_special_tokens": lambda v: v is False,  # the chat template writes them
}


def refuse_unknown(
    body: Mapping[str, Any], cls: type, refused: Mapping[str, Any], ignored: Mapping[str, Any]
) -> None:
    """Every field neither ``cls`` nor the refusals by name know is refused (a null counts as
    absent), unless ignoring it changes nothing (``ignored``). An ignored field would make the
    client believe it was honoured."""
    known = {*cls.__struct_fields__, *refused, *structured.FIELDS}
    unknown = [
        name
        for name, value in body.items()
        if value is not None and name not in known and not ignored.get(name, _NEVER)(value)
    ]
    if not unknown:
        return
    names = ", ".join(repr(name) for name in unknown[:8])
    raise InvalidRequestError(
        f"kvmesh does not support {names} on this route (or not at "
        f"{quote_value(body[unknown[0]])}); remove {'it' if len(unknown) == 1 else 'them'}. What it "
        "takes is listed in /openapi.json, what it ignores in docs/openai_api.md",
        param=unknown[0],
        code="unsupported_parameter",
    )


def _NEVER(value: Any) -> bool:
    return False


def refuse_unsupported(body: Mapping[str, Any], table: Mapping[str, tuple[Any, str]]) -> None:
    for name, (is_harmless, message) in table.items():
        if name in body and not is_harmless(body[name]):
            raise InvalidRequestError(
                f"{message} (got {name}={quote_value(body[name])})",
                param=name,
                code="unsupported_parameter",
            )
