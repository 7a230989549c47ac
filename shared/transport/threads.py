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
