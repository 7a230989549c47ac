"""A registered memory region: the span a transport registration names, and what it grants.

One type in process and on the wire: a transport's ``register`` returns a ``MemoryRegion``, and
the regions a ``TransportDescriptor`` advertises are the same values, decoded (and checked) from
a NATS message. It lives in the kv plane, below the transports, so the descriptor can carry it
without importing torch or a transport; ``kvmesh.shared.transport`` re-exports both names.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec bounds stop at int64


class Access(enum.IntFlag):
    """What a registration allows. Local access is always granted to the registering process."""

    LOCAL = 0
    REMOTE_WRITE = 1
    REMOTE_READ = 2
    REMOTE = REMOTE_WRITE | REMOTE_READ


class MemoryRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A registered span ``[addr, addr + length)`` in the registering process's address space.

    ``rkey`` names the registration to peers (and locally, to find the memory again);
    ``lkey`` is for backends that have one (rdma), 0 elsewhere.
    """

    addr: U64
    length: U64
    rkey: U32
    # An int on the wire, bounded there (an IntFlag field would take any int, -1 included);
    # always an ``Access`` once built.
    access: Annotated[int, msgspec.Meta(ge=0, le=int(Access.REMOTE))] = Access.LOCAL
    lkey: U32 = 0

    def __post_init__(self) -> None:
        msgspec.structs.force_setattr(self, "access", Access(self.access))

    @property
    def end(self) -> int:
        return self.addr + self.length
