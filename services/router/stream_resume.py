"""A client resumes its stream through this router: find it on the mesh, get its tokens so far.

A client whose stream ended without ``[DONE]`` (its router died) sends the same request again,
to any router, with ``Last-Event-ID`` (the id of the last event it got: stream_ids.py). The
router asks every decode worker which one holds the request's stream (``StreamLookup`` on
``STREAM_LOOKUP``; each answers, so "nobody" is known as soon as every live worker said so),
subscribes to that attempt's token events, and only then asks that worker for every event so
far (``StreamResume``: from now on the stream is this router's instance's, so its old router's
death no longer aborts it). The events the replay and the subscription both bring are counted
once (MeshRequest.adopt). ``resume_events`` cuts the replay where the client stopped, so that
the events past that point carry exactly the text the client has not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import nats.errors
from kvmesh.services.router.errors import (
    ApiError,
    GatewayTimeoutError,
    InvalidRequestError,
    MeshError,
    ServiceUnavailableError,
)
from kvmesh.services.router.stream_ids import EventId
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.token_streams import (
    StreamHolder,
    StreamLookup,
    StreamReplay,
    StreamResume,
    TokenEvent,
)
from kvmesh.shared.config.subjects import Subjects
from nats.aio.client import Client as NATS


class StreamNotFoundError(ApiError):
    """404: no decode worker holds a stream of this request id."""

    status = 404
    error_type = "invalid_request_error"
    default_code = "stream_not_found"


class StreamExpiredError(ApiError):
    """410: the stream existed but can no longer be resumed (ended too long ago, too long,
    aborted): send the request again without Last-Event-ID."""

    status = 410
    error_type = "invalid_request_error"
    default_code = "stream_expired"


async def find_stream(
    nc: NATS, subjects: Subjects, request_id: str, num_workers: int, timeout_s: float
) -> StreamHolder:
    """The decode worker and wire id of ``request_id``'s stream: asks every decode worker and
    waits for the holder, or for ``num_workers`` answers (the live decode workers), or for
    ``timeout_s``. StreamNotFoundError / StreamExpiredError when nobody holds it."""
    inbox = nc.new_inbox()
    replies: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_reply(msg) -> None:
        replies.put_nowait(msg.data)

    expired_on = ""
    num_answers = 0
    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        data = encode_message(StreamLookup(request_id))
        await nc.publish(subjects.STREAM_LOOKUP, data, reply=inbox)
        deadline = time.monotonic() + timeout_s
        while num_answers < max(1, num_workers):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                raw = await asyncio.wait_for(replies.get(), left)
            except TimeoutError:
                break
            num_answers += 1
            try:
                holder = decode_message(raw, StreamHolder)
            except MessageError:  # a peer of another version: it holds nothing we can use
                continue
            if holder.wire_id:
                return holder
            if holder.expired:
                expired_on = holder.worker_id
    except nats.errors.Error as exc:
        raise ServiceUnavailableError(f"cannot ask the mesh for the stream: {exc}") from None
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
    if expired_on:
        raise StreamExpiredError(
            f"the stream of {request_id} has ended and its grace is over (decode worker "
            f"{expired_on} forgot it): send the request again without Last-Event-ID",
            param="Last-Event-ID",
        )
    raise StreamNotFoundError(
        f"no decode worker holds a stream of {request_id} ({num_answers} of {num_workers} "
        "asked answered): it is unknown, it ended long ago, or it had no token yet; send the "
        "request again without Last-Event-ID",
        param="Last-Event-ID",
    )


async def ask_replay(
    nc: NATS,
    subjects: Subjects,
    holder: StreamHolder,
    router: str,
    num_prompt_tokens: int,
    timeout_s: float,
) -> StreamReplay:
    """Every event of the stream ``holder`` names, from its decode worker, which hands the
    stream to the router instance ``router``. StreamExpiredError when it cannot be resumed."""
    resume = StreamResume(holder.wire_id, router, num_prompt_tokens)
    try:
        msg = await nc.request(
            subjects.decode_stream_resume(holder.worker_id), encode_message(resume), timeout_s
        )
        replay = decode_message(msg.data, StreamReplay)
    except nats.errors.TimeoutError:
        raise GatewayTimeoutError(
            f"decode worker {holder.worker_id} did not hand over the stream within {timeout_s:g}s"
        ) from None
    except nats.errors.Error as exc:
        raise ServiceUnavailableError(
            f"cannot reach decode worker {holder.worker_id}: {exc}"
        ) from None
    except MessageError as exc:
        raise MeshError(
            f"decode worker {holder.worker_id} sent a malformed replay: {exc}"
        ) from None
    if replay.error:
        raise StreamExpiredError(
            f"the stream of {holder.wire_id} cannot be resumed: {replay.error}; send the "
            "request again without Last-Event-ID",
            param="Last-Event-ID",
        )
    return replay


def resume_events(
    replay: StreamReplay, last: EventId, wants_logprobs: bool, wire_id: str
) -> list[TokenEvent]:
    """The replay as the relay takes it: a migrated attempt's earlier output first, and the
    event in which the client stopped cut in two at its last token, so that the events past
    ``last`` carry only text the client has not seen. InvalidRequestError when ``last`` names
    more tokens than the stream has made."""
    events = list(replay.events)
    if replay.prior_token_ids:
        if wants_logprobs:
            raise StreamExpiredError(
                f"the stream of {wire_id} migrated between decode workers, and the logprobs of "
                "its tokens before that are gone: send the request again",
                param="Last-Event-ID",
            )
        events.insert(0, TokenEvent(wire_id, replay.prior_token_ids))
    num_made = sum(len(e.token_ids) for e in events)
    if last.num_tokens > num_made:
        raise InvalidRequestError(
            f"Last-Event-ID names token {last.num_tokens} of {last.request_id}, whose stream "
            f"has made {num_made} so far; is it this request's?",
            param="Last-Event-ID",
        )
    cut: list[TokenEvent] = []
    num_seen = 0
    for event in events:
        first, n = num_seen, len(event.token_ids)
        num_seen += n
        if first < last.num_tokens < num_seen:  # the client stopped inside this event
            k = last.num_tokens - first
            head = msgspec.structs.replace(
                event,
                token_ids=event.token_ids[:k],
                logprobs=event.logprobs[:k],
                finish_reason=None,
                num_accepted_drafts=0,
            )
            tail = msgspec.structs.replace(
                event,
                token_ids=event.token_ids[k:],
                logprobs=event.logprobs[k:],
                prompt_logprobs=(),
            )
            cut += [head, tail]
        else:
            cut.append(event)
    return cut
