"""Placement: router -> kv-registry -> decode worker, and the leases that hold the blocks.

The router asks the registry to place a request (``PlaceRequest``); the registry reserves blocks
on a decode worker (``ReserveRequest`` / ``ReserveReply``) and answers where the prefill must
write (``PlaceReply``). The lease holder renews the reservation while it waits (``LeaseRenew``);
the registry cancels one it never handed on (``LeaseCancel``)."""

from __future__ import annotations

from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.text.sampling import SamplingOptions


class PlaceRequest(Message):
    """Ask the registry for a decode worker and reserved blocks for one request."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool  # the decode worker prefills the prompt itself
    lease_ms: int = 30_000
    # model_spec() of the router's model: only decode workers advertising the same one may take
    # the request ("" places on any, as before this field)
    model_spec: str = ""
    # the instance of the router that holds the request (its heartbeats'): when the registry
    # announces that router gone, decode and prefill drop its requests ("" never)
    router: str = ""


class ReserveRequest(Message):
    """Registry -> chosen decode worker: reserve blocks (or accept a local-prefill request)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    local_prefill: bool
    lease_id: str
    lease_ms: int
    router: str = ""  # PlaceRequest.router: the request ends if that router is gone


class DecodeRankTarget(Message):
    """Where one tensor-parallel decode rank (1..TP-1) holds a reservation's blocks, for the
    prefill rank(s) writing that rank's KV heads (docs/tp.md): the key of the window it opened
    over the blocks for this lease alone, their addresses in its region, and its transport
    descriptor. The blocks are the same ids on every rank; rank 0's are the message's own fields.
    ``block_bytes``: the rank's block, when its share of the heads is not rank 0's (an uneven
    split: 3 KV heads at TP2 are 2 + 1); 0 when it is rank 0's (``ReserveReply.block_bytes``)."""

    rkey: int
    block_addrs: tuple[int, ...]
    descriptor: TransportDescriptor
    block_bytes: int = 0


class ReserveReply(Message):
    """Decode worker -> registry: the blocks it reserved (or why it could not)."""

    ok: bool
    worker_id: str
    block_ids: tuple[int, ...] = ()
    error: str = ""
    # The key of the window the decode worker opened over exactly these blocks, for this lease
    # alone (closed when the lease ends); 0 for local prefill, which writes nothing remotely.
    rkey: int = 0
    # Where those blocks are in its registered region (the prefill's write targets). A memory
    # address travels only in the messages of one lease, beside its window key (this reply,
    # the PlaceReply, the PrefillJob), never in a broadcast advert (issue 40).
    block_addrs: tuple[int, ...] = ()
    # a tensor-parallel decode worker's ranks 1..TP-1 (rank 0's are the fields above); empty at
    # TP1
    ranks: tuple[DecodeRankTarget, ...] = ()


class PlaceReply(Message):
    """Where the prefill must write: the decode worker's descriptor, the lease's window key and
    the block addresses."""

    ok: bool
    request_id: str
    worker_id: str = ""
    lease_id: str = ""
    descriptor: TransportDescriptor | None = None  # None unless ok
    rkey: int = 0
    block_ids: tuple[int, ...] = ()
    block_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    error: str = ""
    retry_after_s: float = 0.0  # > 0: overloaded, try again later (HTTP 429/503)
    # The registry placed a remote-prefill request where its prefix is cached (or readable from a
    # kv-store) and had the decode worker prefill the short suffix past it itself: no prefill job
    # is to be published.
    local_prefill: bool = False
    cached_tokens: int = 0  # prompt tokens the registry expects the worker's prefix cache to hold
    ranks: tuple[DecodeRankTarget, ...] = ()  # ReserveReply.ranks: a TP decode worker's others


class LeaseRenew(Message):
    """Lease holder -> decode worker (and registry): still waiting for this prefill; keep the
    blocks ``lease_ms`` more. A lease ends when its holder stops renewing, not when work is slow."""

    request_id: str
    lease_id: str
    lease_ms: int


class LeaseCancel(Message):
    """Registry -> decode worker: a reservation it asked for under ``lease_id`` was never handed
    to anyone (the reply did not come in time, so the request went elsewhere): free its blocks,
    or refuse the reservation if it has not arrived yet."""

    request_id: str
    lease_id: str
    reason: str = "no reserve reply in time"
