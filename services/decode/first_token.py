"""Where a decode (or colocated) worker's share of a request's time to first token went.

The router times a request from its arrival to its first token, and a prefill worker reports
its own queue and compute time. What happens inside the decode worker before the first token is
only known here:

- a local prefill (every request of a colocated worker) waits from being accepted until the
  scheduler computes its first chunk (``wait_s``), then takes ``prefill_s`` from that step's
  start to the end of the step that sampled its first token: its chunks and the steps it
  shared with other sequences' decodes and chunks;
- a remote prefill waits from its prefill being heard complete until the worker admits it
  between two steps (``wait_s``: the step in flight); the worker times that one itself.

``FirstTokenClock`` keeps the local prefills' stamps (pure: times are given, never read) and
hands them out once, on the request's first token event (``TokenEvent.wait_s``/``prefill_s``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Stamps:
    accepted_at: float
    started_at: float | None = None  # start of the step that computed its first chunk
    ready: tuple[float, float] | None = None  # (wait_s, prefill_s) once its first token exists


class FirstTokenClock:
    """Stamps of requests that have no first token yet."""

    def __init__(self) -> None:
        self._stamps: dict[str, _Stamps] = {}

    def __len__(self) -> int:
        return len(self._stamps)

    def accepted(self, request_id: str, now: float) -> None:
        """A local prefill was accepted (queued for the engine)."""
        self._stamps[request_id] = _Stamps(now)

    def after_step(
        self,
        started_at: float,
        ended_at: float,
        computed: Callable[[str], int | None],
        with_token: Iterable[str],
    ) -> None:
        """After one engine step that began at ``started_at``: ``computed(rid)`` gives a
        request's computed tokens (None: not in the engine); ``with_token``: the requests the
        step gave tokens."""
        for rid, stamps in self._stamps.items():
            if stamps.started_at is None and (computed(rid) or 0) > 0:
                stamps.started_at = started_at
        for rid in with_token:
            stamps = self._stamps.get(rid)
            if stamps is not None and stamps.ready is None:
                start = started_at if stamps.started_at is None else stamps.started_at
                stamps.ready = (max(0.0, start - stamps.accepted_at), max(0.0, ended_at - start))

    def take(self, request_id: str) -> tuple[float, float]:
        """``(wait_s, prefill_s)`` of a request's first token event, forgotten once taken;
        ``(0, 0)`` for a request without stamps or without a first token yet."""
        stamps = self._stamps.get(request_id)
        if stamps is None or stamps.ready is None:
            return 0.0, 0.0
        del self._stamps[request_id]
        return stamps.ready

    def forget(self, request_id: str) -> None:
        """The request ended before its first token (aborted, failed)."""
        self._stamps.pop(request_id, None)
