"""The recent token events of each stream, so a client cut off from its router can resume (pure).

Every TokenEvent the decode worker publishes goes through ``StreamLog.record``. A router that a
client reconnects to with ``Last-Event-ID`` (services/router/stream_resume.py) finds the stream
by the client's request id (``find``: its latest attempt here) and gets every event from the
stream's first token (``replay``), then reads the live ones; the text after the client's last
event depends on every token before it (characters cut between tokens, stop strings), so a
replay always starts at the first token.

Bounds: ``max_tokens`` per stream (a longer one drops its events and answers "too long");
``max_streams`` streams (the oldest ended ones go first); an ended stream (finished, aborted)
is kept ``grace_s`` after its last event, then forgotten, its id remembered as expired for two
minutes so that a late resume is told "expired", not "unknown". A migrated attempt
(``<id>-m<n>``) carries the output its predecessors sent in its prompt: its log keeps that
prompt, and ``replay`` hands the router the part after the client's own prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvmesh.shared.bus.messages.token_streams import StreamReplay, TokenEvent
from kvmesh.shared.bus.recent_ids import RecentIds
from kvmesh.shared.bus.wire_ids import attempt_of, is_migrated

TOO_LONG = "too long to resume"


@dataclass(slots=True)
class LoggedStream:
    wire_id: str
    prompt_ids: tuple[int, ...] = ()  # a migrated attempt's: the output before it rides here
    events: list[TokenEvent] = field(default_factory=list)
    num_tokens: int = 0
    ended_at: float | None = None  # of its last event (finish, abort, error)
    why_not: str = ""  # why it cannot be resumed ("" when it can)


@dataclass(slots=True)
class StreamLog:
    max_tokens: int = 4096  # per stream
    grace_s: float = 10.0  # an ended stream is kept this long
    max_streams: int = 4096
    _streams: OrderedDict[str, LoggedStream] = field(default_factory=OrderedDict)  # by wire id
    _ended: OrderedDict[str, float] = field(default_factory=OrderedDict)  # wire id -> when
    _latest: dict[str, str] = field(default_factory=dict)  # response id -> its latest wire id
    _expired: RecentIds = field(default_factory=RecentIds)  # response ids forgotten lately

    def __len__(self) -> int:
        return len(self._streams)

    def record(self, event: TokenEvent, now: float, prompt_ids: tuple[int, ...] = ()) -> None:
        """``event`` as published; ``prompt_ids``: the sequence's prompt, read for a migrated
        attempt's first event only (``wants_prompt``)."""
        stream = self._streams.get(event.request_id)
        if stream is None:
            stream = LoggedStream(event.request_id, prompt_ids)
            self._streams[event.request_id] = stream
            response_id, _ = attempt_of(event.request_id)
            self._latest[response_id] = event.request_id
        if event.index != 0:
            stream.why_not, stream.events = "of n > 1 choices", []
        elif not stream.why_not:
            stream.num_tokens += len(event.token_ids)
            if stream.num_tokens > self.max_tokens:
                stream.why_not, stream.events = (
                    f"{TOO_LONG}: longer than the {self.max_tokens} tokens a decode worker "
                    "keeps of a stream (--resume-max-tokens)",
                    [],
                )
            else:
                stream.events.append(event)
        if event.finish_reason is not None and stream.ended_at is None:
            stream.ended_at = now
            self._ended[stream.wire_id] = now
            if event.finish_reason in ("abort", "error") and not stream.why_not:
                why = event.error or "no reason given"
                stream.why_not = f"the stream ended with {event.finish_reason!r} ({why})"
        self.expire(now)

    def wants_prompt(self, wire_id: str) -> bool:
        """Whether ``record`` needs the prompt of ``wire_id``'s next event: a migrated attempt's
        first."""
        return wire_id not in self._streams and is_migrated(wire_id)

    def find(self, response_id: str, now: float) -> tuple[str, bool]:
        """The wire id of the latest attempt of ``response_id`` logged here ("" if none), and
        whether one was forgotten lately (an expired stream, not an unknown one)."""
        self.expire(now)
        wire = self._latest.get(response_id, "")
        return wire, not wire and self._expired.seen(response_id, now)

    def replay(self, wire_id: str, num_prompt_tokens: int, now: float) -> StreamReplay:
        """Every logged event of ``wire_id`` in order, or why it cannot be resumed.
        ``num_prompt_tokens``: the client request's own prompt (a migrated attempt's prompt
        carries the earlier output after it)."""
        self.expire(now)
        stream = self._streams.get(wire_id)
        if stream is None:
            return StreamReplay(error=f"no stream {wire_id} here (it ended, or it moved)")
        if stream.why_not:
            return StreamReplay(error=stream.why_not)
        prior: tuple[int, ...] = ()
        if is_migrated(wire_id):
            if len(stream.prompt_ids) < num_prompt_tokens:
                return StreamReplay(
                    error=f"stream {wire_id} has a prompt of {len(stream.prompt_ids)} tokens, "
                    f"shorter than the request's {num_prompt_tokens}: not the same request"
                )
            prior = stream.prompt_ids[num_prompt_tokens:]
        return StreamReplay(events=tuple(stream.events), prior_token_ids=prior)

    def expire(self, now: float) -> None:
        """Forget streams that ended more than ``grace_s`` ago, and the oldest ended ones past
        ``max_streams`` (live ones are bounded by the engine's sequences)."""
        while self._ended and (
            len(self._streams) > self.max_streams
            or now - next(iter(self._ended.values())) > self.grace_s
        ):
            wire, _ = self._ended.popitem(last=False)
            self._forget(wire, now)

    def _forget(self, wire: str, now: float) -> None:
        del self._streams[wire]
        response_id, _ = attempt_of(wire)
        if self._latest.get(response_id) == wire:
            del self._latest[response_id]
            self._expired.add(response_id, now)
