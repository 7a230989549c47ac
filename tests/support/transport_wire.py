"""Test helpers for the data plane's wire: a remote key for a whole region (peers reach memory
through windows only), and raw tcp lanes that pass (or fail) the receiver's handshake."""

from __future__ import annotations

import socket

import msgspec
from kvmesh.shared.kv.descriptor import TcpBackend
from kvmesh.shared.transport import Access, MemoryRegion, TransportDescriptor
from kvmesh.shared.transport.lane_auth import (
    ACCEPT,
    CHALLENGE,
    HELLO,
    MAC_BYTES,
    answer_challenge,
    parse_secret,
)


def remote(transport, region: MemoryRegion, access: Access | None = None) -> MemoryRegion:
    """``region`` as a peer reaches it: the key of a window over all of it (a region's own key
    opens nothing from the network). Deregister the original region, not this copy."""
    window = transport.open_window(region, [(region.addr, region.length)], access or region.access)
    return msgspec.structs.replace(region, rkey=window.rkey)


def over_the_wire(descriptor: TransportDescriptor) -> TransportDescriptor:
    """``descriptor`` as a peer gets it: encoded, sent, decoded (and checked) by the schema."""
    return msgspec.json.decode(msgspec.json.encode(descriptor), type=TransportDescriptor)


def tcp_part(descriptor: TransportDescriptor) -> TcpBackend:
    info = descriptor.backend("tcp")
    assert info is not None, f"{descriptor.peer_id} offers no tcp backend"
    return info


def tcp_secret(descriptor: TransportDescriptor) -> bytes:
    return parse_secret(tcp_part(descriptor).secret)


def hello_bytes(
    sock: socket.socket, secret: bytes, peer: bytes = b"raw-peer", endpoint_id: int = 7
) -> bytes:
    """Read the receiver's challenge from ``sock``; the hello that answers it."""
    challenge = sock.recv(CHALLENGE.size, socket.MSG_WAITALL)
    assert len(challenge) == CHALLENGE.size, "the receiver sent no challenge"
    return answer_challenge(secret, challenge, 0, 1, endpoint_id, peer.decode())


def raw_lane(
    descriptor: TransportDescriptor, endpoint_id: int = 7, peer: bytes = b"raw-peer"
) -> socket.socket:
    """A tcp lane to ``descriptor``'s receiver past its handshake: frames may follow."""
    info = tcp_part(descriptor)
    sock = socket.create_connection((info.host, info.port), timeout=10)
    sock.sendall(hello_bytes(sock, tcp_secret(descriptor), peer, endpoint_id))
    try:
        accepted = sock.recv(len(ACCEPT), socket.MSG_WAITALL) == ACCEPT
    except ConnectionResetError:
        accepted = False
    assert accepted, "the receiver refused the hello"
    return sock


def accept_hello(conn: socket.socket, secret: bytes) -> bytes:
    """A fake receiver's side of the handshake (it checks nothing): challenge, hello, accept.
    Returns the hello's peer id."""
    conn.sendall(CHALLENGE.pack(b"KVMC", 2, b"\x00" * 16))
    header = conn.recv(HELLO.size, socket.MSG_WAITALL)
    n = HELLO.unpack(header)[-1]
    peer = conn.recv(n + MAC_BYTES, socket.MSG_WAITALL)[:n]
    conn.sendall(ACCEPT)
    return peer


FAKE_SECRET = "cd" * 32  # the secret a fake receiver's descriptor names (it checks no proof)
