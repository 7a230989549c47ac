"""What entered and left a block manager's prefix cache since it was last asked: the decode
worker's source of KV events for the kv-registry's prefix index.

The log keeps only each hash's latest change (a block cached then evicted within one batch is a
removal), so a batch is bounded by the distinct hashes touched. Past ``max_events`` it stops
recording and says it overflowed: the publisher then sends a full digest instead, which is what a
registry needs anyway when it may have missed something. The engine step runs in a worker thread
while the service takes batches on the event loop, hence the lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheEvents:
    """One batch: hashes now cached, hashes no longer cached, and whether changes were lost."""

    stored: tuple[int, ...]
    removed: tuple[int, ...]
    overflowed: bool


class CacheEventLog:
    def __init__(self, max_events: int = 4096) -> None:
        assert max_events > 0
        self.max_events = max_events
        self._lock = threading.Lock()
        self._changes: dict[int, bool] = {}  # hash -> True: stored, False: removed
        self._overflowed = False

    def on_stored(self, block_hash: int) -> None:
        self._record(block_hash, True)

    def on_removed(self, block_hash: int) -> None:
        self._record(block_hash, False)

    def _record(self, block_hash: int, stored: bool) -> None:
        with self._lock:
            if self._overflowed:
                return
            self._changes.pop(block_hash, None)  # keep the latest change last
            self._changes[block_hash] = stored
            if len(self._changes) > self.max_events:
                self._changes.clear()
                self._overflowed = True

    def take(self) -> CacheEvents:
        """The changes since the last ``take`` (the log starts empty again)."""
        with self._lock:
            changes, overflowed = self._changes, self._overflowed
            self._changes, self._overflowed = {}, False
        return CacheEvents(
            stored=tuple(h for h, s in changes.items() if s),
            removed=tuple(h for h, s in changes.items() if not s),
            overflowed=overflowed,
        )
