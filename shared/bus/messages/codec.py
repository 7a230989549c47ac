"""The base of every NATS message and the one codec: ``encode_message`` writes a message as
JSON, ``decode_message(data, Type)`` validates JSON against the Struct (types, required fields,
no unknown fields, the bounds in its ``Meta``) and raises ``MessageError`` naming the type and
the field when a peer sends something malformed. Why msgspec and not pydantic: docs/schema.md."""

from __future__ import annotations

import functools
import re
from typing import TypeVar

import msgspec


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every NATS message: immutable, and refused on decode if it carries a field the
    receiver does not know (a peer of another version, or a typo)."""


class Part(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A part of a message (a row of a table, a worker's load), never sent alone; decoded as
    strictly."""


M = TypeVar("M", bound=Message)


class MessageError(ValueError):
    """A NATS message that does not decode into the expected message type."""


_ENCODER = msgspec.json.Encoder()


def encode_message(msg: Message) -> bytes:
    """``msg`` as JSON bytes."""
    assert isinstance(msg, Message), type(msg)
    return _ENCODER.encode(msg)


def decode_message(data: bytes, cls: type[M]) -> M:
    """Validate ``data`` against ``cls`` and build it; MessageError says what is wrong, where."""
    try:
        return _decoder(cls).decode(data)
    except msgspec.ValidationError as exc:
        raise MessageError(_explain(cls.__name__, str(exc))) from None
    except msgspec.DecodeError as exc:
        raise MessageError(f"{cls.__name__}: body is not JSON ({exc})") from None


@functools.cache
def _decoder(cls: type[M]) -> msgspec.json.Decoder[M]:
    return msgspec.json.Decoder(cls)


_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.S)


def _explain(type_name: str, error: str) -> str:
    """msgspec's ``Expected `int`, got `str` - at `$.token_ids[1]``` as
    ``TokenEvent.token_ids[1]: expected int, got str``."""
    parts = _AT.match(error)
    assert parts is not None
    what, path = parts["what"], parts["path"] or ""
    if m := _MISSING.match(what):
        what = f"missing field {m['name']!r}"
    elif m := _UNKNOWN.match(what):
        what = f"unknown field {m['name']!r}"
    else:
        what = (what[:1].lower() + what[1:]).replace("`", "")
    return f"{type_name}{path}: {what}"
