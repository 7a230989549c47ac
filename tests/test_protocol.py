import pytest
from kvmesh.shared.protocol import (
    Abort,
    DecodeAdvert,
    PlaceReply,
    PlaceRequest,
    ProtocolError,
    SamplingOptions,
    TokenEvent,
    decode,
    encode,
)


def test_round_trip_preserves_nested_and_tuple_fields():
    msg = PlaceRequest("r1", (1, 2, 3), SamplingOptions(seed=7, stop=("\n",)), local_prefill=False)
    assert decode(encode(msg), PlaceRequest) == msg


def test_round_trip_of_pairs_and_dicts():
    advert = DecodeAdvert(
        worker_id="d0",
        mode="disagg",
        descriptor={"backend": "tcp", "port": 1},
        base_addr=4096,
        block_bytes=65536,
        block_size=16,
        kv_spec="4x2x64:f32",
        total_blocks=10,
        free_blocks=7,
        free_block_ranges=((0, 3), (6, 10)),
        num_running=1,
        num_waiting=0,
        state="ready",
        sent_at=1.5,
    )
    assert decode(encode(advert), DecodeAdvert) == advert


def test_defaults_fill_missing_optional_fields():
    assert decode(b'{"ok": false, "request_id": "x"}', PlaceReply) == PlaceReply(False, "x")


def test_decode_rejects_wrong_type_naming_the_field():
    with pytest.raises(ProtocolError, match=r"TokenEvent.token_ids\[1\]: expected int"):
        decode(b'{"request_id": "r", "token_ids": [1, "2"]}', TokenEvent)


def test_decode_rejects_missing_required_field():
    with pytest.raises(ProtocolError, match="missing field 'request_id'"):
        decode(b"{}", Abort)


def test_decode_rejects_unknown_field_and_bad_json():
    with pytest.raises(ProtocolError, match="unknown fields"):
        decode(b'{"request_id": "r", "bogus": 1}', Abort)
    with pytest.raises(ProtocolError, match="not JSON"):
        decode(b"{nope", Abort)


def test_model_spec_is_what_router_and_decode_both_compute_and_tells_models_apart():
    """The router reads only the config; a decode worker loads the weights, maybe in another
    dtype: both get the same model_spec. Another shape gets another."""
    import torch
    from kvmesh.shared.model.loader import load_config_and_tokenizer
    from kvmesh.shared.model.seeded import SeededShape
    from kvmesh.shared.protocol import model_spec

    router_config, _ = load_config_and_tokenizer("kvmesh-tiny")
    decode_config, _ = load_config_and_tokenizer("kvmesh-tiny", torch.bfloat16)
    assert model_spec(router_config) == model_spec(decode_config)
    mc = router_config
    assert model_spec(mc).startswith(
        f"L{mc.num_hidden_layers}-H{mc.num_key_value_heads}-D{mc.head_dim}:model-"
    )
    assert model_spec(SeededShape().config()) != model_spec(router_config)
