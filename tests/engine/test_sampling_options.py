"""SamplingOptions: one type from the HTTP body to the engine, one set of bounds for all."""

from __future__ import annotations

import msgspec
import pytest
from kvmesh.services.router.request_bodies import ChatCompletionRequest, CompletionRequest
from kvmesh.shared.bus.messages.codec import decode_message, encode_message
from kvmesh.shared.bus.messages.placement import PlaceRequest
from kvmesh.shared.text.sampling import SamplingOptions
from kvmesh.shared.text.structured_output import StructuredOutputs

EVERY_FIELD = SamplingOptions(
    max_tokens=7,
    n=3,
    temperature=0.5,
    top_p=0.9,
    top_k=40,
    seed=-3,
    stop=("\n", "END"),
    stop_token_ids=(2, 9),
    include_stop_str_in_output=True,
    ignore_eos=True,
    min_tokens=3,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.3,
    logit_bias={5: -100.0, 7: 2.5},
    logprobs=2,
    prompt_logprobs=1,
    structured_outputs=StructuredOutputs(choice=("a", "b")),
    cache_salt="tenant-a",
)


def test_every_field_round_trips_on_the_wire():
    for field in msgspec.structs.fields(EVERY_FIELD):
        assert getattr(EVERY_FIELD, field.name) != field.default, field.name
    place = PlaceRequest("r", (1, 2), EVERY_FIELD, local_prefill=False)
    assert decode_message(encode_message(place), PlaceRequest).sampling == EVERY_FIELD


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_k", -1),
        ("stop", ("",)),
        ("stop", tuple(f"s{i}" for i in range(17))),
        ("stop_token_ids", (-1,)),
        ("seed", 2**63),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logprobs", 21),
        ("min_tokens", -1),
        ("n", 0),
        ("n", 17),
    ],
)
def test_construction_and_decoding_refuse_the_same_values(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingOptions(**{field: value})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({field: value}, SamplingOptions)


def test_sequences_are_stored_as_tuples_and_one_stop_string_is_a_list_of_one():
    options = SamplingOptions(stop="x", stop_token_ids=[3])  # type: ignore[arg-type]
    assert options.stop == ("x",)
    assert options.stop_token_ids == (3,)


@pytest.mark.parametrize("body", [CompletionRequest, ChatCompletionRequest])
def test_http_bodies_take_every_sampling_option(body):
    own = set(body.__struct_fields__)
    assert set(SamplingOptions.__struct_fields__) <= own
