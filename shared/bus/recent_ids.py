"""Ids seen lately, remembered for a while: a late message about something that already ended.

A reservation that comes after its request was aborted, or after the registry gave it up, and a
draft context that comes after its sequence was forgotten, would otherwise hold blocks or memory
for nobody until a lease or an eviction. Their services remember the ids that ended for
``ttl_s`` (longer than any message stays in flight) and refuse what comes after. Pure, clock
passed in, bounded: at most ``max_ids`` are kept, the oldest go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class RecentIds:
    ttl_s: float = 120.0
    max_ids: int = 65_536
    _added: OrderedDict[str, float] = field(default_factory=OrderedDict)  # id -> when

    def add(self, key: str, now: float) -> None:
        self._added.pop(key, None)
        self._added[key] = now
        self._expire(now)

    def __contains__(self, key: str) -> bool:
        return key in self._added

    def seen(self, key: str, now: float) -> bool:
        """Whether ``key`` was added within the last ``ttl_s``."""
        self._expire(now)
        return key in self._added

    def __len__(self) -> int:
        return len(self._added)

    def _expire(self, now: float) -> None:
        while self._added and (
            len(self._added) > self.max_ids or now - next(iter(self._added.values())) > self.ttl_s
        ):
            self._added.popitem(last=False)
