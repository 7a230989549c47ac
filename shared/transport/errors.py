"""Errors of the KV data plane: one base class, and the reasons a remote access is refused.

Writers see ``RemoteAccessError`` (with a ``RefusalReason`` that travels on the wire as a tcp NAK
or an shm notification) for an access the receiver refused; every other failure is one of the
subclasses below, each with a message that says what to do.
"""

from __future__ import annotations

import enum


class TransportError(Exception):
    """Base class of every data-plane error."""


class RefusalReason(enum.IntEnum):
    """Why a remote access was refused; travels on the wire (tcp NAK, shm notification)."""

    UNKNOWN_RKEY = 1
    DEREGISTERED = 2
    OUT_OF_BOUNDS = 3
    ACCESS_DENIED = 4
    BAD_LENGTH = 5
    # What a receiver answers a peer for every refusal above (tcp NAK, rdma resolution): the
    # peer learns only "refused", never whether a key was unknown, closed or out of bounds, so
    # refusals are no oracle for probing keys. The receiver logs the reason.
    REFUSED = 6


_REASON_HINTS = {
    RefusalReason.UNKNOWN_RKEY: "rkey was never registered on the receiver; use the rkey from its "
    "MemoryRegion or its TransportDescriptor",
    RefusalReason.DEREGISTERED: "the region was deregistered on the receiver; fetch a fresh "
    "descriptor before writing again",
    RefusalReason.OUT_OF_BOUNDS: "[remote_addr, remote_addr+length) is outside the registered "
    "region [addr, addr+length)",
    RefusalReason.ACCESS_DENIED: "the region was not registered with the access this operation "
    "needs (REMOTE_WRITE for write, REMOTE_READ for read)",
    RefusalReason.BAD_LENGTH: "length must be positive and at most the transport's max frame size",
    RefusalReason.REFUSED: "the receiver refused the access (an unknown or closed key, a span "
    "outside its window, or the wrong access; it does not say which, its log does); use the key "
    "of a live lease window for exactly that window's blocks",
}


class RemoteAccessError(TransportError):
    """The target refused a write or read: bad rkey, out of bounds, deregistered, wrong access."""

    def __init__(
        self, reason: RefusalReason, detail: str = "", cause: RefusalReason | None = None
    ) -> None:
        self.reason = RefusalReason(reason)
        self.detail = detail
        self.cause = cause  # REFUSED: the reason behind it, where this side knows it
        msg = f"remote access refused ({self.reason.name.lower()}): {_REASON_HINTS[self.reason]}"
        super().__init__(f"{msg}; {detail}" if detail else msg)


class LocalAccessError(TransportError):
    """A WriteEntry's local side is outside its local MemoryRegion, or the region is unknown."""


class PeerUnreachableError(TransportError):
    """connect() could not reach the peer through any backend both sides support."""


class PeerGoneError(TransportError):
    """The peer vanished (process died, connection reset) while an operation was in flight."""


class ProtocolError(TransportError):
    """A peer sent a corrupt or truncated frame; the connection is closed."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot run here; the message says what is missing."""


class TransportClosedError(TransportError):
    """The transport or endpoint was closed."""
