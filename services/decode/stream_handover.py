"""A decode worker's side of a stream that a client resumes through another router (NATS shell).

Every TokenEvent the service publishes is logged first (``record``: stream_log.py), so a replay
holds at least what any subscriber heard. A router looking for a request's stream asks every
decode worker on ``STREAM_LOOKUP`` (a plain subscription: every worker must hear it, which a
micro endpoint's queue group would not); this one answers with the attempt it logged, or that it
logged none. The router then subscribes to that attempt's tokens and asks this worker directly
(``decode_stream_resume``) for the replay (``replay``); the service hands the stream to that
router's instance at the same time (docs/faults.md: a resumed stream is not its dead router's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import nats.errors
from kvmesh.services.decode.stream_log import StreamLog
from kvmesh.shared.bus.messages.codec import MessageError, decode_message, encode_message
from kvmesh.shared.bus.messages.token_streams import (
    StreamHolder,
    StreamLookup,
    StreamReplay,
    StreamResume,
    TokenEvent,
)
from kvmesh.shared.bus.nats_subscribe import guarded_subscribe
from kvmesh.shared.config.subjects import Subjects
from kvmesh.shared.obs import logs
from nats.aio.client import Client
from nats.aio.msg import Msg

log = logs.get_logger(__name__)


class StreamHandover:
    def __init__(
        self,
        nc: Client,
        subjects: Subjects,
        worker_id: str,
        streams: StreamLog,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._nc = nc
        self._subjects = subjects
        self._worker_id = worker_id
        self.streams = streams
        self._clock = clock

    def record(self, event: TokenEvent, prompt_of: Callable[[str], tuple[int, ...]]) -> None:
        """Log ``event`` before it is published; ``prompt_of(wire id)``: the sequence's prompt
        (asked only for a migrated attempt's first event)."""
        wire = event.request_id
        prompt = prompt_of(wire) if self.streams.wants_prompt(wire) else ()
        self.streams.record(event, self._clock(), prompt)

    def replay(self, resume: StreamResume) -> StreamReplay:
        return self.streams.replay(resume.wire_id, resume.num_prompt_tokens, self._clock())

    async def on_lookup(self, msg: Msg) -> None:
        try:
            lookup = decode_message(msg.data, StreamLookup)
        except MessageError as exc:
            log.info("malformed stream lookup", error=str(exc))
            return
        wire, expired = self.streams.find(lookup.request_id, self._clock())
        holder = StreamHolder(self._worker_id, wire, expired)
        try:
            await self._nc.publish(msg.reply, encode_message(holder))
        except nats.errors.Error as exc:  # the router asks again, or gives up
            log.debug("stream lookup not answered", error=str(exc))

    @contextlib.asynccontextmanager
    async def subscribed(self) -> AsyncIterator[None]:
        """Answer stream lookups for the duration of the block."""
        sub = await guarded_subscribe(
            self._nc, self._subjects.STREAM_LOOKUP, self.on_lookup, needs_reply=True
        )
        try:
            yield
        finally:
            if not self._nc.is_closed:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
