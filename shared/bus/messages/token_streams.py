"""A request's token stream: decode -> router events, aborts, and resuming a stream through
another router (docs/faults.md)."""

from __future__ import annotations

from typing import Annotated

import msgspec
from kvmesh.shared.bus.messages.codec import Message
from kvmesh.shared.text.sampling import TokenLogprobs


class TokenEvent(Message):
    """Decode -> router: new tokens of one request; the last one has finish_reason set."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""
    # of token_ids, how many were draft tokens the decode worker verified and accepted
    num_accepted_drafts: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Only on a request's first event, where the decode worker's time went before it (seconds):
    # wait_s: a local prefill, accepted to its first chunk computed; a remote one, its prefill
    # heard done to admitted (the step in flight). prefill_s: a local prefill's first chunk to
    # its first token (the steps it shared with other sequences included); 0 for a remote one.
    wait_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    prefill_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    # with SamplingOptions.logprobs: one per token of token_ids
    logprobs: tuple[TokenLogprobs, ...] = ()
    # which of the request's SamplingOptions.n choices; num_output_tokens and finish_reason are
    # that choice's (the request ends when each choice has finished)
    index: Annotated[int, msgspec.Meta(ge=0)] = 0
    # with SamplingOptions.prompt_logprobs, on choice 0's first event: of prompt tokens 1..
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class Abort(Message):
    """Router (or decode worker) -> everyone: stop working on this request."""

    request_id: str
    reason: str = "client disconnected"
    # The router took the prefill job off the queue before any worker took it: nothing will
    # ever write the reserved blocks, so the decode worker may free them at once.
    job_withdrawn: bool = False


class StreamLookup(Message):
    """Router -> every decode worker (request; the router gathers the replies): which of you
    holds the stream of the client request ``request_id``?"""

    request_id: str


class StreamHolder(Message):
    """Decode worker -> router: ``wire_id``, the latest attempt of the looked-up request that
    this worker logged ("" for none; ``expired``: it had one and forgot it, its grace over)."""

    worker_id: str
    wire_id: str = ""
    expired: bool = False


class StreamResume(Message):
    """Router -> the decode worker holding a stream (request/reply): its events so far. The
    router's instance ``router`` serves the stream from now on: the stream is no longer its
    old router's (whose death would abort it)."""

    wire_id: str
    router: str
    num_prompt_tokens: Annotated[int, msgspec.Meta(ge=1)]  # of the client's request


class StreamReplay(Message):
    """Decode worker -> router: the stream's TokenEvents from its first token, in order (a
    migrated attempt's earlier output in ``prior_token_ids``); ``error`` says why it cannot be
    resumed (then no events)."""

    events: tuple[TokenEvent, ...] = ()
    prior_token_ids: tuple[int, ...] = ()
    error: str = ""
