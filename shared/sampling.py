"""How to sample one request's output: ``SamplingOptions``, the one definition of every option.

The same Struct is the options' type at every layer, so a new option is added here once:
- the router's HTTP bodies (``services/router/schema.py``) subclass it, which puts its fields,
  bounds and descriptions into request validation and ``/openapi.json``;
- the NATS messages that carry a request (``PlaceRequest``, ``PrefillJob``, ...) hold it, and
  decoding them checks its bounds;
- the engine samples by it (``Sequence.params``).

Bounds are ``Meta`` constraints, checked by msgspec when a body or message is decoded and by
``__post_init__`` when code builds the options directly, so both paths refuse the same values
with a message naming the field. Torch-free: the router imports it.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any

import msgspec
from msgspec import Meta

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1

NonEmptyStr = Annotated[str, Meta(min_length=1)]
TokenId = Annotated[int, Meta(ge=0)]


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick output tokens. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    disable those filters; ``seed`` makes a request's tokens reproducible whichever worker
    samples them (with or without speculative decoding)."""

    max_tokens: Annotated[int, Meta(ge=1, description="Output tokens at most")] = 16
    temperature: Annotated[float, Meta(ge=0, le=2, description="0: greedy")] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1, description="1: off")] = 1.0
    top_k: Annotated[int, Meta(ge=0, description="0: off (every token is a candidate)")] = 0
    seed: Annotated[int, Meta(ge=-MAX_SEED, le=MAX_SEED)] | None = None
    stop: Annotated[
        tuple[NonEmptyStr, ...],
        Meta(
            max_length=MAX_STOP_STRINGS,
            description="Text that ends the output (not included in it)",
            extra={"expects": f"a list of at most {MAX_STOP_STRINGS} non-empty strings"},
        ),
    ] = ()
    stop_token_ids: tuple[TokenId, ...] = ()
    ignore_eos: Annotated[bool, Meta(description="Generate past the end-of-sequence token")] = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single stop string, as OpenAI's API allows
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        check_fields(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def check_fields(options: msgspec.Struct) -> None:
    """Check every field of ``options`` against its annotated type and bounds (what decoding
    checks), storing sequences as tuples; ValueError names the field. For Structs built in
    code: a decoded one has passed these checks already."""
    for name, kind in _field_types(type(options)).items():
        value = getattr(options, name)
        try:
            checked = msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:  # "Expected `float` >= 0.0[ - at `$[0]`]"
            what, _, where = (
                str(exc).removeprefix("Expected ").replace("`", "").partition(" - at $")
            )
            raise ValueError(
                f"{name}{where} must be {what.split(', got ')[0]}, got {value!r}"
            ) from None
        if checked is not value and isinstance(checked, tuple):
            msgspec.structs.force_setattr(options, name, checked)


@functools.cache
def _field_types(cls: type[msgspec.Struct]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {name: hints[name] for name in cls.__struct_fields__}
