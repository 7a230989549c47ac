"""How to sample one request's output: ``SamplingOptions``, the one definition of every option.

The same Struct is the options' type at every layer, so a new option is added here once:
- the router's HTTP bodies (``services/router/request_bodies.py``) subclass it, which puts its
  fields, bounds and descriptions into request validation and ``/openapi.json``;
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
from kvmesh.shared.text.structured_output import StructuredOutputs
from msgspec import Meta

MAX_STOP_STRINGS = 16
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # alternatives per token, as vLLM's default --max-logprobs
MAX_LOGIT_BIAS = 1024  # tokens biased per request
MAX_CHOICES = 16  # SamplingOptions.n
MAX_CACHE_SALT = 256  # characters of SamplingOptions.cache_salt

NonEmptyStr = Annotated[str, Meta(min_length=1)]
TokenId = Annotated[int, Meta(ge=0)]


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick output tokens. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1
    disable those filters; ``seed`` makes a request's tokens reproducible whichever worker
    samples them (with or without speculative decoding)."""

    max_tokens: Annotated[int, Meta(ge=1, description="Output tokens at most")] = 16
    n: Annotated[
        int,
        Meta(
            ge=1,
            le=MAX_CHOICES,
            description="Choices to generate (the prompt is prefilled once, its KV shared)",
        ),
    ] = 1
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
    stop_token_ids: Annotated[
        tuple[TokenId, ...], Meta(description="Tokens that end the output (not included in it)")
    ] = ()
    include_stop_str_in_output: Annotated[
        bool, Meta(description="Keep the stop string that ended the output")
    ] = False
    ignore_eos: Annotated[bool, Meta(description="Generate past the end-of-sequence token")] = False
    min_tokens: Annotated[
        int, Meta(ge=0, description="Stop tokens and EOS cannot end the output before this many")
    ] = 0
    min_p: Annotated[
        float, Meta(ge=0, le=1, description="Drop tokens less likely than min_p x the likeliest")
    ] = 0.0
    presence_penalty: Annotated[
        float, Meta(ge=-2, le=2, description="Subtracted from the logit of every output token")
    ] = 0.0
    frequency_penalty: Annotated[
        float,
        Meta(ge=-2, le=2, description="Times a token's count in the output, subtracted from it"),
    ] = 0.0
    repetition_penalty: Annotated[
        float,
        Meta(
            gt=0,
            le=10,
            description="Prompt and output tokens' logits divided by it (multiplied if negative)",
        ),
    ] = 1.0
    logit_bias: Annotated[
        dict[TokenId, Annotated[float, Meta(ge=-100, le=100)]],
        Meta(
            max_length=MAX_LOGIT_BIAS,
            description="Token id -> a bias added to its logit",
            extra={"expects": "an object of token id -> a number in [-100, 100]"},
            extra_json_schema={"propertyNames": {"pattern": "^[0-9]{1,9}$"}},
        ),
    ] = {}
    logprobs: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_LOGPROBS,
                description="Return each output token's log-probability and this many likeliest",
            ),
        ]
        | None
    ) = None
    prompt_logprobs: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_LOGPROBS,
                description="Score the prompt: each token's log-probability and this many likeliest",
            ),
        ]
        | None
    ) = None
    structured_outputs: Annotated[
        StructuredOutputs | None,
        Meta(description="The grammar the output follows (vLLM's; or response_format)"),
    ] = None
    cache_salt: Annotated[
        str,
        Meta(
            max_length=MAX_CACHE_SALT,
            description="Requests share cached prompt blocks only with requests of the same salt "
            "(vLLM's; the router may salt by API key too)",
        ),
    ] = ""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # a single stop string, as OpenAI's API allows
            msgspec.structs.force_setattr(self, "stop", (self.stop,))
        check_fields(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def changes_logits(self) -> bool:
        """Whether an option acts on the logits before the draw (penalties, bias, min_tokens)."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One output token's log-probability under the model (its log-softmax, before any sampling
    option) and the ``SamplingOptions.logprobs`` likeliest tokens' (ids and log-probabilities,
    likeliest first)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    rank: int = 0  # 1 + how many tokens are likelier (0: not given)


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
