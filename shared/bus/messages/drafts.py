"""Speculative decoding: decode <-> draft workers (contexts, proposals), and the draft KV a
prefill worker writes into a draft worker's blocks."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.kv.descriptor import TransportDescriptor


class DraftContext(Message):
    """Decode worker -> draft workers: the tokens of one decoding sequence from position
    ``start`` on. ``start`` 0 carries the whole context (prompt + output); later messages carry
    only what was appended since the last one. A draft worker that does not hold the tokens
    before ``start`` answers with ``DraftProposal(need_context=True)``."""

    request_id: str
    decode_worker_id: str
    start: Annotated[int, msgspec.Meta(ge=0)]
    token_ids: tuple[int, ...]
    num_prompt_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    # How the decode worker fared with this draft worker's proposals since the last message:
    # draft tokens on the verified paths, and how many of them it accepted.
    num_verified: Annotated[int, msgspec.Meta(ge=0)] = 0
    num_accepted: Annotated[int, msgspec.Meta(ge=0)] = 0


class DraftProposal(Message):
    """Draft worker -> the sequence's decode worker: a tree of draft tokens that continues the
    sequence when it has exactly ``position`` tokens (stale otherwise, and dropped).
    ``parents[i]`` is the index of node i's parent, -1 for the sequence's last token; a chain
    is ``parents == (-1, 0, 1, ...)``. A tree may reach ``depth`` plus a few tokens deeper
    (lookahead): by the time it arrives the sequence may have grown by tokens that lie on one
    of its paths, and the subtree below them is then still a valid proposal (``depth`` deep at
    most: the decode worker cuts the rest)."""

    request_id: str
    draft_worker_id: str
    position: Annotated[int, msgspec.Meta(ge=1)]
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    need_context: bool = False  # the draft worker lost the sequence: send it from start 0
    depth: Annotated[int, msgspec.Meta(ge=0)] = 0  # verify at most this deep (0: no limit)


class DraftForget(Message):
    """Decode worker -> the draft worker that holds a sequence: it finished or was aborted."""

    request_id: str


class DraftKvReserve(Message):
    """Prefill -> any early-exit or model draft worker (request, queue group ``draft``):
    reserve blocks for the prompt's full blocks of draft KV, to be written by this prefill
    worker."""

    request_id: str
    lease_id: str
    prompt_ids: tuple[int, ...]
    kv_spec: str  # the prefill worker's KV layout (kv_spec_fingerprint): the draft's target's
    lease_ms: Annotated[int, msgspec.Meta(ge=1)]
    # the KV layout of the draft model the prefill worker runs beside its target (--draft-model;
    # kv_spec_fingerprint): a model draft worker reserves only for its own; "" runs none
    draft_kv_spec: str = ""


class DraftKvReserveReply(Message):
    """Draft worker -> prefill: where to write the first ``num_layers`` layers of each full
    prompt block (early exit) or, with ``whole_blocks``, the prefill's draft model's whole
    blocks (model), into a window over exactly these blocks (key ``rkey``); or why not."""

    ok: bool
    worker_id: str
    descriptor: TransportDescriptor | None = None  # None unless ok
    rkey: int = 0
    block_addrs: tuple[int, ...] = ()
    block_bytes: int = 0
    num_layers: int = 0
    error: str = ""
    whole_blocks: bool = False  # a model draft worker's: blocks of the draft model's layout
