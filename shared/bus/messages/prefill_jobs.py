"""Prefill jobs: router -> prefill queue -> prefill worker -> decode worker.

A job names the decode worker's blocks to write (``PrefillJob``); the worker that takes it says
so (``PrefillStarted``), announces every write done (``PrefillDone``) and reports its timings to
the router (``PrefillReport``)."""

from __future__ import annotations

from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.bus.messages.placement import DecodeRankTarget
from kvmesh.shared.kv.descriptor import TransportDescriptor
from kvmesh.shared.text.sampling import SamplingOptions, TokenLogprobs


class PrefillJob(Message):
    """Router -> prefill queue group: compute this prompt's KV into these remote blocks."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingOptions
    decode_worker_id: str
    lease_id: str
    descriptor: TransportDescriptor
    rkey: int
    block_addrs: tuple[int, ...]
    block_bytes: int
    enqueued_at: float  # unix time the router published the job
    router: str = ""  # PlaceRequest.router: the job is dropped if that router is gone
    # PlaceReply.ranks: a tensor-parallel decode worker's ranks 1..TP-1, each holding its share
    # of the KV heads (descriptor, rkey, block_addrs above are rank 0's); empty at TP1
    ranks: tuple[DecodeRankTarget, ...] = ()


class PrefillStarted(Message):
    """Prefill -> router (request subject) and decode worker: this worker took the job. The router
    retries the request elsewhere if this worker dies before the first token; the decode worker
    knows whose writes to expect, so it can free the blocks at once when that writer is gone."""

    request_id: str
    lease_id: str
    worker_id: str


class PrefillDone(Message):
    """Prefill -> decode worker: every write of the request has been issued and completed."""

    request_id: str
    lease_id: str
    ok: bool
    first_token: int = -1
    # the decode worker admits once it has counted this many immediates (a tensor-parallel one:
    # each of its ranks, every rank taking as many writes of a job)
    num_writes: int = 0
    error: str = ""
    # The lease's window key from the job: only the holder of the job knows it, so the decode
    # worker ignores an announcement without it.
    rkey: int = 0
    # To the decode worker: the draft worker that received the prompt's draft KV through the
    # data plane ("" if none did); the decode worker sends that worker the first DraftContext.
    draft_worker_id: str = ""
    first_logprobs: TokenLogprobs | None = None  # the first token's, when the options ask
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # of prompt tokens 1.., when they ask


class PrefillReport(Message):
    """Prefill -> router: where the time went (seconds)."""

    request_id: str
    worker_id: str
    queue_s: float
    compute_s: float
    transfer_s: float
    exposed_transfer_s: float  # transfer time not hidden behind compute
    num_chunks: int
