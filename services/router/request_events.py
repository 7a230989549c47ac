"""What the router hears about one attempt of a request, typed.

Everything about a request flows on ``<prefix>.request.<wire id>.>`` (``Subjects.request_events``).
The router reads four of those subjects, each with one message type; ``AttemptEvents`` turns a
message into that type, or says it is malformed (``MalformedEvent``, naming the type it should
have been), or that its subject is none of the four (``None``: another kind of request event, not
the router's business)."""

from __future__ import annotations

from kvmesh.shared.bus.messages.codec import MessageError, decode_message
from kvmesh.shared.bus.messages.prefill_jobs import PrefillReport, PrefillStarted
from kvmesh.shared.bus.messages.token_streams import TokenEvent
from kvmesh.shared.bus.messages.workers import WorkerGone
from kvmesh.shared.config.subjects import Subjects

RequestEvent = TokenEvent | PrefillReport | PrefillStarted | WorkerGone


class MalformedEvent(Exception):
    """A message on one of the attempt's subjects that is not the type that subject carries."""

    def __init__(self, kind: type[RequestEvent], error: MessageError) -> None:
        super().__init__(str(error))
        self.kind = kind
        self.error = error


class AttemptEvents:
    """The typed events of the attempt ``wire_id``."""

    def __init__(self, subjects: Subjects, wire_id: str) -> None:
        self._kinds: dict[str, type[RequestEvent]] = {
            subjects.request_tokens(wire_id): TokenEvent,  # decode -> router
            subjects.request_prefill_report(wire_id): PrefillReport,  # prefill -> router
            subjects.request_prefill_started(wire_id): PrefillStarted,  # prefill -> router
            subjects.request_worker_gone(wire_id): WorkerGone,  # router -> itself
        }

    def decode(self, subject: str, data: bytes) -> RequestEvent | None:
        """The event a message on ``subject`` carries; None for a subject the router does not
        read. Raises ``MalformedEvent``."""
        kind = self._kinds.get(subject)
        if kind is None:
            return None
        try:
            return decode_message(data, kind)
        except MessageError as exc:
            raise MalformedEvent(kind, exc) from None
