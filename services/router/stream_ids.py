"""The ``id:`` of every SSE event of a resumable stream, and what a resumed stream sends (pure).

An event's id is ``<request id>:<tokens>:<slot>``: the tokens of the choice the client has been
sent through this event, and which event of that point it is. The slots follow the order a
stream sends them in: ``TOKENS`` (the chat role chunk at 0 tokens, then one chunk per step's
tokens), then at the end ``TAIL`` (text held back for a possible stop string), ``FINISH``
(the finish reason), ``USAGE``, ``ERROR`` and ``DONE`` (``data: [DONE]``). Ids only grow, so
``(tokens, slot)`` orders a stream's events. A router that resumes a stream
(services/router/stream_resume.py) rebuilds its text from the same token events its first router
had (the decode worker's log of them), cut where the client stopped, and sends only the events
past the one the client names in ``Last-Event-ID``: the text as a whole is the text of a stream
that never broke. (A migrated stream's tokens before its migration come back as one event, so
the chunks of that part may be cut differently; their text is the same.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvmesh.services.router.errors import InvalidRequestError

TOKENS, TAIL, FINISH, USAGE, ERROR, DONE = range(6)

# responses.new_request_id: "cmpl-" or "chatcmpl-" and 24 hex digits
_ID = re.compile(
    r"^(?P<rid>(?P<kind>cmpl|chatcmpl)-[0-9a-f]{24}):(?P<tokens>\d{1,9}):(?P<slot>\d)$"
)


@dataclass(frozen=True, slots=True)
class EventId:
    request_id: str
    num_tokens: int
    slot: int

    def __str__(self) -> str:
        return f"{self.request_id}:{self.num_tokens}:{self.slot}"

    @property
    def point(self) -> tuple[int, int]:
        """Where in the stream this event is: events are sent in ``point`` order."""
        return self.num_tokens, self.slot

    @classmethod
    def parse(cls, text: str, kind: str) -> EventId:
        """A client's ``Last-Event-ID`` on a ``kind`` ("chat" or "completion") route;
        InvalidRequestError when it is not an id this router's streams send."""
        match = _ID.match(text.strip())
        if match is None or int(match["slot"]) > DONE:
            raise InvalidRequestError(
                "Last-Event-ID must be the id of an event of a stream this mesh sent, e.g. "
                f"'chatcmpl-<24 hex digits>:12:0'; got {text[:80]!r}",
                param="Last-Event-ID",
            )
        if (match["kind"] == "chatcmpl") != (kind == "chat"):
            route = "/v1/chat/completions" if match["kind"] == "chatcmpl" else "/v1/completions"
            raise InvalidRequestError(
                f"Last-Event-ID {match['rid']} is a stream of {route}; resume it there",
                param="Last-Event-ID",
            )
        return cls(match["rid"], int(match["tokens"]), int(match["slot"]))


@dataclass(slots=True)
class EventIds:
    """The ids of one stream's events as it sends them; ``after``: a resumed stream sends only
    the events past that point (the client has the rest)."""

    request_id: str
    after: tuple[int, int] = (-1, 0)

    def next(self, num_tokens: int, slot: int) -> EventId | None:
        """The id of the event at ``num_tokens`` / ``slot``; None when the client has it."""
        event_id = EventId(self.request_id, num_tokens, slot)
        return event_id if event_id.point > self.after else None


@dataclass(frozen=True, slots=True)
class Resume:
    """A stream a client resumes: the last event it got, and whether it asked for logprobs."""

    last: EventId
    wants_logprobs: bool
