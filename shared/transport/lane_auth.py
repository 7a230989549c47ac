"""Proof that a tcp lane belongs to the mesh, before the receiver holds anything for it.

Each tcp receiver draws a 32-byte secret when it starts and puts it in its descriptor, which
travels only over authenticated NATS (adverts, replies, jobs). On every accepted connection the
receiver sends a challenge with a fresh 16-byte nonce; the writer answers with its hello and
``HMAC-SHA256(secret, LABEL | nonce | hello header | peer id)``. The receiver checks the MAC in
constant time and only then gives the lane a thread and a connection slot (``server.py``). A
wrong MAC, a malformed hello and a full server get the same answer: the connection is closed
with nothing said. The nonce makes every proof single-use, so a recorded hello cannot be
replayed.

Pure: no sockets. ``HelloReader`` is the receiver's side, fed bytes as they arrive;
``answer_challenge`` is the writer's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

MAGIC_CHALLENGE, MAGIC_HELLO, MAGIC_ACCEPT = b"KVMC", b"KVMH", b"KVMO"
VERSION = 2
SECRET_BYTES = 32
NONCE_BYTES = 16
MAC_BYTES = 32
MAX_PEER_ID = 256
LABEL = b"kvmesh tcp lane v2\x00"
# CHALLENGE: magic, version, nonce
CHALLENGE = struct.Struct(f"<4sH{NONCE_BYTES}s")
# HELLO: magic, version, lane, num_lanes, endpoint id, peer id length (+ peer id, + MAC)
HELLO = struct.Struct("<4sHHHQH")
ACCEPT = MAGIC_ACCEPT  # the receiver's answer to a hello it admits; a refusal is a hang-up


class HelloRefused(Exception):
    """A hello the receiver does not admit (the reason is logged, never sent)."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: object) -> bytes:
    """A descriptor's ``secret`` field (hex) as bytes; raises ValueError saying what is wrong."""
    if not isinstance(text, str) or len(text) != 2 * SECRET_BYTES:
        raise ValueError(
            f"a tcp descriptor's secret must be {2 * SECRET_BYTES} hex digits; "
            "use the descriptor the receiver advertised"
        )
    try:
        return bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"a tcp descriptor's secret is not hex: {exc}") from None


def _mac(secret: bytes, nonce: bytes, header: bytes, peer_id: bytes) -> bytes:
    return hmac.new(secret, LABEL + nonce + header + peer_id, hashlib.sha256).digest()


RDMA_LABEL = b"kvmesh rdma side channel v2\x00"


def side_channel_proof(secret: bytes, nonce: bytes, hello: bytes) -> str:
    """The rdma side channel's proof (hex) of a hello (its canonical JSON) for ``nonce``: the
    same idea as a tcp lane's, under a label of its own."""
    return hmac.new(secret, RDMA_LABEL + nonce + hello, hashlib.sha256).hexdigest()


def proof_matches(secret: bytes, nonce: bytes, hello: bytes, proof: object) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(
        proof, side_channel_proof(secret, nonce, hello)
    )


@dataclass(frozen=True, slots=True)
class LaneHello:
    """An admitted hello: which lane of which writer endpoint, and the id the writer declared
    (a member of the mesh, since it knew the secret; the id itself is its own claim)."""

    lane: int
    num_lanes: int
    endpoint_id: int
    peer_id: str


def answer_challenge(
    secret: bytes, challenge: bytes, lane: int, num_lanes: int, endpoint_id: int, peer_id: str
) -> bytes:
    """The writer's hello for ``challenge`` (CHALLENGE.size bytes from the receiver)."""
    magic, version, nonce = CHALLENGE.unpack(challenge)
    if magic != MAGIC_CHALLENGE or version != VERSION:
        raise ValueError(f"not a kvmesh tcp receiver of version {VERSION}: {challenge[:6]!r}")
    raw = peer_id.encode()[:MAX_PEER_ID]
    header = HELLO.pack(MAGIC_HELLO, VERSION, lane, num_lanes, endpoint_id, len(raw))
    return header + raw + _mac(secret, nonce, header, raw)


class HelloReader:
    """The receiver's side of one connection's handshake: ``challenge()`` goes out first, then
    ``feed`` takes exactly ``need()`` bytes at a time until it returns the ``LaneHello``."""

    def __init__(self, secret: bytes, nonce: bytes | None = None) -> None:
        assert len(secret) == SECRET_BYTES
        self._secret = secret
        self._nonce = nonce if nonce is not None else secrets.token_bytes(NONCE_BYTES)
        self._header: bytes | None = None
        self._buf = bytearray()

    def challenge(self) -> bytes:
        return CHALLENGE.pack(MAGIC_CHALLENGE, VERSION, self._nonce)

    def need(self) -> int:
        """Bytes still missing before the next step of the parse."""
        if self._header is None:
            return HELLO.size - len(self._buf)
        n = HELLO.unpack(self._header)[5]
        return n + MAC_BYTES - len(self._buf)

    def feed(self, data: bytes) -> LaneHello | None:
        """Take bytes (at most ``need()``); the hello once complete and proven, else None.
        Raises HelloRefused on a malformed hello or a wrong MAC."""
        assert len(data) <= self.need()
        self._buf += data
        if self.need():
            return None
        if self._header is None:
            self._header, self._buf = bytes(self._buf), bytearray()
            magic, version, lane, num_lanes, _, n = HELLO.unpack(self._header)
            if magic != MAGIC_HELLO or version != VERSION:
                raise HelloRefused(f"bad hello magic/version {self._header[:6]!r}")
            if not 0 < n <= MAX_PEER_ID or not lane < num_lanes:
                raise HelloRefused(f"bad hello: peer id of {n} bytes, lane {lane}/{num_lanes}")
            return None
        n = HELLO.unpack(self._header)[5]
        raw, mac = bytes(self._buf[:n]), bytes(self._buf[n:])
        if not hmac.compare_digest(mac, _mac(self._secret, self._nonce, self._header, raw)):
            raise HelloRefused("the hello's proof does not match this receiver's secret")
        _, _, lane, num_lanes, endpoint_id, _ = HELLO.unpack(self._header)
        return LaneHello(lane, num_lanes, endpoint_id, raw.decode(errors="replace"))


__all__ = [
    "ACCEPT",
    "CHALLENGE",
    "HELLO",
    "HelloReader",
    "HelloRefused",
    "LaneHello",
    "answer_challenge",
    "new_secret",
    "parse_secret",
    "proof_matches",
    "side_channel_proof",
]
