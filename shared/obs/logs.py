"""structlog on top of stdlib logging: one line per event, JSON (containers) or console (humans).

Every line about a request carries its ``request_id``: a handler binds it once for the code
it runs (``request_context``), so one ``grep <request id>`` over every service's log follows the
request across the mesh.

Levels are stdlib levels on the root logger, so ``set_level`` (driven by the
``kvmesh.control.log_level`` subject) changes every logger of the process at run time, kvmesh's
and libraries' alike.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvmesh.shared.config.service_config import option

if TYPE_CHECKING:
    import structlog

LogLevelName = Literal["debug", "info", "warning", "error", "critical"]
LogFormat = Literal["console", "json"]
LEVELS: tuple[str, ...] = typing.get_args(LogLevelName)


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Read by every ``kvmesh serve`` process (flags --log-level/--log-format, KVMESH_LOG_*)."""

    log_level: LogLevelName = option("info", help="log level")
    log_format: LogFormat = option("console", help="console for humans, json for collectors")


def setup_logging(level: str = "info", fmt: str = "console") -> None:
    """Configure structlog and the stdlib root logger (stderr). Call once, from ``main``."""
    import structlog  # here, not at import: `kvmesh --help` stays fast

    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be console or json, got {fmt!r}")
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    set_level(level)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def set_level(level: str) -> None:
    """Change the level of every logger in the process; raises ValueError on an unknown name."""
    name = level.strip().lower()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LEVELS)}")
    logging.getLogger().setLevel(name.upper())


def current_level() -> str:
    return logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    import structlog

    return structlog.get_logger(name)


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Inside the block, every log line of this task (and of the tasks and threads it starts)
    carries ``request_id``; contextvars keep concurrent requests apart."""
    import structlog

    with structlog.contextvars.bound_contextvars(request_id=request_id):
        yield


def is_sampled(count: int) -> bool:
    """Whether the ``count``-th occurrence of a repeated event is logged: the 1st, 10th and
    100th, then every 1,000th, so probing or a fault shows without flooding the logs."""
    return count in (1, 10, 100) or count % 1000 == 0
