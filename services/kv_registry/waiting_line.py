"""Placements that found no room, in arrival order (pure, clock passed in).

A placement the registry refuses as full is retried by its router every 0.25-0.75 s (jittered):
without a line, whoever asked first after room freed won it, and a big prompt among a stream
of small ones waited for minutes (issue 43: a 2,890-token prompt waited 100 s beside 6 clients
sending 600-token prompts). The line remembers each refused request by its wire id from its
first refusal on. Once the oldest waiter has waited ``aging_s`` it is the line's head: a later
request is placed only where the head still fits after it (``RegistryState.choose``'s
``held_tokens``), so the head is served as soon as its blocks free, before later ones.
A waiter that has not asked again within ``forget_s`` gave up (its client went, or it was
placed elsewhere) and leaves the line.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Waiter:
    request_id: str
    num_tokens: int  # the prompt's tokens: the blocks it needs
    arrived_at: float  # its first refusal
    asked_at: float  # its latest


@dataclass(slots=True)
class WaitingLine:
    aging_s: float = 1.0  # a waiter holds back later requests once it has waited this long
    forget_s: float = 5.0  # a waiter silent this long gave up (routers ask again within 0.75 s)
    waiters: dict[str, Waiter] = field(default_factory=dict)  # arrival order

    def head_before(self, request_id: str, now: float) -> Waiter | None:
        """The oldest waiter that came before ``request_id`` (every waiter, for a request not
        in the line) and has waited ``aging_s``: the room ``request_id`` must leave for it."""
        self._forget(now)
        for waiter in self.waiters.values():
            if waiter.request_id == request_id:
                return None
            if now - waiter.arrived_at >= self.aging_s:
                return waiter
        return None

    def wait(self, request_id: str, num_tokens: int, now: float) -> None:
        """``request_id`` found no room: it joins the line at its end, or keeps its place."""
        waiter = self.waiters.get(request_id)
        if waiter is None:
            self.waiters[request_id] = Waiter(request_id, num_tokens, now, now)
        else:
            waiter.asked_at = now

    def leave(self, request_id: str) -> None:
        """Placed, or refused for good."""
        self.waiters.pop(request_id, None)

    def _forget(self, now: float) -> None:
        gone = [w for w, v in self.waiters.items() if now - v.asked_at > self.forget_s]
        for request_id in gone:
            del self.waiters[request_id]
