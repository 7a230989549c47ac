"""A plain-text progress bar on stderr: redrawn in place on a terminal, a line per tenth otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvmesh.loadgen.serve_metrics import RequestRecord


class ProgressBar:
    def __init__(
        self, total: int, label: str, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.num_done = 0
        self.num_failed = 0
        self._is_tty = self.stream.isatty()
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._last_tenth = 0

    def update(self, record: RequestRecord) -> None:
        self.num_done += 1
        self.num_failed += not record.is_ok
        now = time.perf_counter()
        if self._is_tty:
            if now - self._last_draw >= 0.1 or self.num_done == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line())
                self.stream.flush()
        else:
            tenth = self.num_done * 10 // max(self.total, 1)
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        filled = self.width * self.num_done // max(self.total, 1)
        bar = "=" * filled + " " * (self.width - filled)
        elapsed = time.perf_counter() - self._start
        failed = f", {self.num_failed} failed" if self.num_failed else ""
        return f"{self.label} [{bar}] {self.num_done}/{self.total}{failed} {elapsed:6.1f}s"

    def close(self) -> None:
        if self._is_tty:
            self.stream.write("\n")
            self.stream.flush()
