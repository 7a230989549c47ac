"""A tcp lane's proof that it belongs to the mesh (shared/transport/lane_auth.py), pure: the
receiver's parse of a hello fed in pieces, and every way a hello is refused."""

from __future__ import annotations

import pytest
from kvmesh.shared.transport.lane_auth import (
    CHALLENGE,
    HELLO,
    MAC_BYTES,
    HelloReader,
    HelloRefused,
    LaneHello,
    answer_challenge,
    new_secret,
    parse_secret,
    proof_matches,
    side_channel_proof,
)


def feed_all(reader: HelloReader, data: bytes) -> LaneHello | None:
    """Feed ``data`` as a server does, ``need()`` bytes at a time; the hello once complete."""
    while data:
        n = reader.need()
        hello, data = reader.feed(data[:n]), data[n:]
        if hello is not None:
            assert not data, "bytes past the hello"
            return hello
    return None


def test_a_hello_proven_with_the_secret_is_admitted() -> None:
    secret = new_secret()
    reader = HelloReader(secret)
    hello = answer_challenge(secret, reader.challenge(), 1, 2, 77, "prefill-0")
    assert len(hello) == HELLO.size + len("prefill-0") + MAC_BYTES
    assert feed_all(reader, hello) == LaneHello(1, 2, 77, "prefill-0")


def test_a_hello_for_another_nonce_or_secret_is_refused() -> None:
    secret = new_secret()
    replayed = answer_challenge(secret, HelloReader(secret).challenge(), 0, 1, 1, "p")
    with pytest.raises(HelloRefused, match="proof"):
        feed_all(HelloReader(secret), replayed)  # a recorded hello, a fresh nonce
    reader = HelloReader(secret)
    other = answer_challenge(new_secret(), reader.challenge(), 0, 1, 1, "p")
    with pytest.raises(HelloRefused, match="proof"):
        feed_all(reader, other)


@pytest.mark.parametrize(
    ("field", "value"), [(0, b"KVMF"), (1, 1), (2, 5), (5, 0), (5, 300)]
)  # magic, version, lane >= num_lanes, empty and oversized peer ids
def test_a_malformed_hello_is_refused_before_its_proof(field: int, value: object) -> None:
    secret = new_secret()
    reader = HelloReader(secret)
    fields = list(
        HELLO.unpack(answer_challenge(secret, reader.challenge(), 0, 1, 1, "p")[: HELLO.size])
    )
    fields[field] = value
    with pytest.raises(HelloRefused):
        reader.feed(HELLO.pack(*fields))


def test_a_hello_fed_byte_by_byte_waits_for_all_of_it() -> None:
    secret = new_secret()
    reader = HelloReader(secret)
    hello = answer_challenge(secret, reader.challenge(), 0, 1, 9, "decode-1")
    for i, byte in enumerate(hello):
        got = reader.feed(bytes([byte]))
        assert (got is None) == (i < len(hello) - 1)


def test_the_writer_refuses_a_challenge_that_is_not_one() -> None:
    with pytest.raises(ValueError, match="not a kvmesh tcp receiver"):
        answer_challenge(new_secret(), b"\0" * CHALLENGE.size, 0, 1, 1, "p")


def test_secrets_parse_from_64_hex_digits_only() -> None:
    secret = new_secret()
    assert parse_secret(secret.hex()) == secret
    for bad in ("", "ab" * 31, "zz" * 32, None, 7):
        with pytest.raises(ValueError, match="secret"):
            parse_secret(bad)


def test_a_side_channel_proof_covers_the_nonce_and_the_hello() -> None:
    secret, nonce = new_secret(), b"n" * 16
    proof = side_channel_proof(secret, nonce, b'{"qp":1}')
    assert proof_matches(secret, nonce, b'{"qp":1}', proof)
    assert not proof_matches(secret, b"m" * 16, b'{"qp":1}', proof)
    assert not proof_matches(secret, nonce, b'{"qp":2}', proof)
    assert not proof_matches(new_secret(), nonce, b'{"qp":1}', proof)
    assert not proof_matches(secret, nonce, b'{"qp":1}', None)
