"""What one source address may cost a receiver: accepts per second, refusals, and a block.

Pure, clock passed in (``SourceGuard`` is the thread-safe shell the receivers share). Per source
address (an IPv4 address; an IPv6 address's /64, which one host owns whole):

* an accept bucket: ``accept_burst`` connections at once, refilled at ``accepts_per_s``. A
  connection past it is reset at accept, before it costs a challenge, a nonce or a slot (issue
  40: 20k connections a second from 199 loopback addresses crowded out a real writer);
* a refusal bucket: ``max_refusals`` refused accesses (from lanes past their hello), refilled over
  ``block_s``. A source that empties it is blocked for ``block_s``: its connections are reset
  at accept and each further refusal ends the lane it came on. A window key guessed from fresh
  endpoints (each allowed ``max_refusals`` of its own) was 16.7k guesses a second; per source it
  is now ``max_refusals`` per ``block_s`` plus one per lane already open.

At most ``max_sources`` sources are remembered; past that, the ones whose buckets are full
again are forgotten first, then the least recently seen.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True, slots=True)
class SourceLimits:
    accepts_per_s: float = 64.0  # sustained new connections per source
    accept_burst: int = 256  # new connections per source at once
    max_refusals: int = 64  # refused accesses per source before it is blocked
    block_s: float = 30.0  # how long a blocked source stays blocked (and the refusal refill)
    max_sources: int = 4096  # sources remembered at once

    def __post_init__(self) -> None:
        if not (self.accepts_per_s > 0 and self.block_s > 0):
            raise ValueError("accepts_per_s and block_s must be positive")
        if min(self.accept_burst, self.max_refusals, self.max_sources) < 1:
            raise ValueError("accept_burst, max_refusals and max_sources must be at least 1")


@dataclass(slots=True)
class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` per second; ``take`` spends one."""

    rate: float
    burst: float
    tokens: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def take(self, now: float) -> bool:
        self.refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def is_full(self, now: float) -> bool:
        self.refill(now)
        return self.tokens >= self.burst


class BudgetVerdict(Enum):
    ADMIT = "admit"
    RATE_LIMITED = "rate limited"  # over the source's accepts per second
    BLOCKED = "blocked"  # the source spent its refusals


@dataclass(slots=True)
class _Source:
    accepts: TokenBucket
    refusals: TokenBucket
    blocked_until: float = 0.0


class SourceBudget:
    """Per-source accept and refusal buckets; the verdicts say what to do with a connection."""

    def __init__(self, limits: SourceLimits | None = None) -> None:
        self.limits = limits or SourceLimits()
        self._sources: OrderedDict[str, _Source] = OrderedDict()  # least recently seen first

    def __len__(self) -> int:
        return len(self._sources)

    def _get(self, source: str, now: float) -> _Source:
        entry = self._sources.get(source)
        if entry is not None:
            self._sources.move_to_end(source)
            return entry
        lim = self.limits
        entry = _Source(
            TokenBucket.full(lim.accepts_per_s, lim.accept_burst, now),
            TokenBucket.full(lim.max_refusals / lim.block_s, lim.max_refusals, now),
        )
        self._sources[source] = entry
        if len(self._sources) > lim.max_sources:
            self._evict(now)
        return entry

    def _evict(self, now: float) -> None:
        over = len(self._sources) - self.limits.max_sources
        settled = [
            key
            for key, s in self._sources.items()
            if s.blocked_until <= now and s.accepts.is_full(now) and s.refusals.is_full(now)
        ]
        for key in settled[:over]:  # forgetting these changes no verdict
            del self._sources[key]
        while len(self._sources) > self.limits.max_sources:
            self._sources.popitem(last=False)

    def admit(self, source: str, now: float) -> BudgetVerdict:
        """A new connection from ``source``: admit it to the handshake, or reset it (why)."""
        entry = self._get(source, now)
        if entry.blocked_until > now:
            return BudgetVerdict.BLOCKED
        return BudgetVerdict.ADMIT if entry.accepts.take(now) else BudgetVerdict.RATE_LIMITED

    def refused(self, source: str, now: float) -> bool:
        """``source`` had an access refused; True when it is (now) blocked."""
        entry = self._get(source, now)
        if not entry.refusals.take(now):
            entry.blocked_until = max(entry.blocked_until, now + self.limits.block_s)
        return entry.blocked_until > now

    def is_blocked(self, source: str, now: float) -> bool:
        entry = self._sources.get(source)
        return entry is not None and entry.blocked_until > now


class SourceGuard:
    """``SourceBudget`` behind a lock on the monotonic clock: shared by a receiver's handshake
    thread and its lane threads."""

    def __init__(self, limits: SourceLimits | None = None) -> None:
        self._budget = SourceBudget(limits)
        self._lock = threading.Lock()
        self.num_blocked = 0  # refusals that found or left their source blocked

    def admit(self, source: str) -> BudgetVerdict:
        with self._lock:
            return self._budget.admit(source, time.monotonic())

    def refused(self, source: str) -> bool:
        with self._lock:
            blocked = self._budget.refused(source, time.monotonic())
            self.num_blocked += blocked
            return blocked


def source_of(address: object) -> str:
    """The source a connection counts against: its IPv4 address, its IPv6 address's /64 (a
    host has a whole /64 to spray from), or "local" for a unix socket."""
    if not (isinstance(address, tuple) and address):
        return "local"
    host = str(address[0])
    if ":" not in host:
        return host
    try:
        ip = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ipaddress.IPv6Network((ip, 64), strict=False))


__all__ = [
    "BudgetVerdict",
    "SourceBudget",
    "SourceGuard",
    "SourceLimits",
    "TokenBucket",
    "source_of",
]
