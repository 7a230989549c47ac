"""The kv-store's conversation: decode/prefill/kv-registry <-> kv-store (docs/kv_store.md).

Blocks are named by the prefix hash chain rooted in the KV layout (``kv_spec``); a store holds
one layout and refuses requests naming another. Bytes move one-sided on the data plane, through
a window per put or get; these messages carry hashes, addresses and window keys only."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message, Part
from kvmesh.shared.bus.worker_state import WorkerState
from kvmesh.shared.kv.descriptor import TransportDescriptor

MAX_STORE_BLOCKS = 16_384  # hashes per put or get


class StoreBlocks(Message):
    """What a put and a get ask of a store alike: blocks of layout ``kv_spec`` by their hashes,
    held for ``lease_ms`` for ``client_id``."""

    client_id: str
    kv_spec: str
    block_hashes: Annotated[
        tuple[int, ...], msgspec.Meta(min_length=1, max_length=MAX_STORE_BLOCKS)
    ]
    lease_ms: Annotated[int, msgspec.Meta(ge=1)] = 30_000


class StorePut(StoreBlocks):
    """Writer -> store: reserve slots for these blocks (the ones it does not hold yet)."""


class StoreSlots(Message):
    """What a store answers a put and a get alike: ``ok`` (else ``error``), and a window onto
    slots of its memory, key ``rkey``: blocks of ``block_bytes`` at ``block_addrs``, their
    headers at ``header_addrs``."""

    ok: bool
    store_id: str
    rkey: int = 0
    block_addrs: tuple[int, ...] = ()
    header_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""


class StorePutReply(StoreSlots):
    """Store -> writer: ``present`` are stored already; write ``write_hashes[i]`` at
    ``block_addrs[i]`` and its header at ``header_addrs[i]`` with window key ``rkey``, then
    commit. Hashes in neither list found no room."""

    put_id: str = ""
    present: tuple[int, ...] = ()
    write_hashes: tuple[int, ...] = ()
    retry_after_s: float = 0.0  # > 0: full of pinned blocks right now


class StoreCommit(Message):
    """Writer -> store: every write of the put has returned; check and index the blocks.
    ``rkey`` is the put's window key (only its writer knows it)."""

    put_id: str
    rkey: int


class StoreCommitReply(Message):
    ok: bool
    committed: tuple[int, ...] = ()
    rejected: tuple[int, ...] = ()  # bad header or bytes: freed, never served
    error: str = ""


class StoreGet(StoreBlocks):
    """Reader -> store: pin the longest leading run of these blocks that is stored."""


class StoreGetReply(StoreSlots):
    """Store -> reader: read ``block_hashes[i]`` from ``block_addrs[i]`` and its header from
    ``header_addrs[i]`` with read-window key ``rkey``, verify, then release. No hashes: a miss."""

    get_id: str = ""
    block_hashes: tuple[int, ...] = ()


class StoreRelease(Message):
    """Reader -> store: done reading; the window closes and the pins drop."""

    get_id: str
    rkey: int


class StoreAck(Message):
    ok: bool
    error: str = ""


class StoreReach(Part):
    """How clients reach a kv-store and what it holds (fixed at start)."""

    descriptor: TransportDescriptor  # .public(): no region keys
    kv_spec: str
    block_bytes: int
    block_size: int
    epoch: str  # this process's incarnation: a restarted store is empty


class StoreLoad(Part):
    """A kv-store's state, blocks and counters at one moment (counters since it started)."""

    state: WorkerState  # ready or draining
    total_blocks: int
    used_blocks: int
    pinned_blocks: int
    hits: int
    misses: int
    evictions: int
    bytes_written: int
    bytes_read: int
    refused_accesses: int
    # the disk tier (--disk-path; all 0 without one): slots, blocks held, gets' blocks found
    # there (of ``hits``), blocks dropped from it to make room
    disk_total_blocks: int = 0
    disk_used_blocks: int = 0
    disk_hits: int = 0
    disk_evictions: int = 0


class StoreAdvert(Message):
    """Store -> registry (and clients), every heartbeat: how to reach it, what it holds."""

    store_id: str
    reach: StoreReach
    load: StoreLoad
    sent_at: float


class StoreSolicit(Message):
    """A store reader that starts (a prefill or decode worker reading or writing stores, the
    kv-registry) -> every kv-store: advertise yourself now, not at your next heartbeat."""

    sender: str  # the worker id that asks (for the logs)
