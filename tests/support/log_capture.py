"""Capture the event dicts structlog hands to stdlib logging, for tests of what a service logs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from kvmesh.shared.obs import logs


class Captured(logging.Handler):
    """The event dicts structlog hands to stdlib logging (setup_logging's pipeline)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.events: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            self.events.append({**record.msg, "level": record.levelname.lower()})


@contextlib.contextmanager
def captured(*names: str, level: str = "info") -> Iterator[Captured]:
    before = logging.getLogger().level
    logs.setup_logging(level)
    handler = Captured()
    for name in names:
        logging.getLogger(name).addHandler(handler)
    try:
        yield handler
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(handler)
        logging.getLogger().setLevel(before)
