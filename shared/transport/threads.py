"""The daemon threads a transport runs (accept loops, per-connection servers), joined on close."""

from __future__ import annotations

import threading
from collections.abc import Callable


class ThreadSet:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()

    def spawn(self, target: Callable[..., object], name: str, *args: object) -> None:
        t = threading.Thread(target=self._run, args=(target, *args), name=name, daemon=True)
        # Start under the lock: join() must never see a thread that is not started yet, and the
        # thread's own discard in _run waits until it has been added.
        with self._lock:
            t.start()
            self._threads.add(t)

    def _run(self, target: Callable[..., object], *args: object) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def join(self) -> None:
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                return
            for t in threads:
                t.join(timeout=5)


class Window:
    """A byte budget one thread takes from and another gives back (a tcp lane's send window).

    ``take`` blocks while the budget is spent; ``close`` wakes every waiter and makes later takes
    fail. Also tracks the peak bytes and items (frames) ever taken at once.
    """

    def __init__(self, limit: int) -> None:
        assert limit > 0
        self.limit = limit
        self._cond = threading.Condition(threading.Lock())
        self._bytes = self._items = 0
        self.peak_bytes = self.peak_items = 0
        self._closed = False

    def take(self, num_bytes: int, *, block: bool = True) -> bool:
        """Reserve ``num_bytes`` for one item; False if closed (or, unblocking, if it is full)."""
        assert 0 < num_bytes <= self.limit
        with self._cond:
            while self._bytes + num_bytes > self.limit and not self._closed:
                if not block:
                    return False
                self._cond.wait()
            if self._closed:
                return False
            self._bytes += num_bytes
            self._items += 1
            self.peak_bytes = max(self.peak_bytes, self._bytes)
            self.peak_items = max(self.peak_items, self._items)
            return True

    def give(self, num_bytes: int, num_items: int = 1) -> None:
        with self._cond:
            self._bytes -= num_bytes
            self._items -= num_items
            assert self._bytes >= 0 and self._items >= 0
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
