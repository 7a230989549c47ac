"""A request's wire ids: the id of each attempt on the mesh of one client request.

A request runs under its client-facing id first, then, each time it runs again, under
``<id>-r<n>`` (from the start) or ``<id>-m<n>`` (its stream migrated), ``n`` counting every
attempt. The router makes them (services/router/attempts.py); a decode worker reads them back
to find the stream of a client's request (services/decode/stream_log.py).
"""

from __future__ import annotations

from typing import Literal


def wire_id(response_id: str, kind: Literal["r", "m"], attempt: int) -> str:
    """The wire id of attempt ``attempt`` (1 and up) of ``response_id``: ``-r<n>`` runs it from
    the start, ``-m<n>`` migrates its stream."""
    return f"{response_id}-{kind}{attempt}"


def attempt_of(wire: str) -> tuple[str, int]:
    """``(response id, attempt number)`` of a wire id: ``X`` is attempt 0 of ``X``, ``X-r2``
    and ``X-m2`` attempt 2 (``wire_id``'s inverse)."""
    base, sep, suffix = wire.rpartition("-")
    if sep and suffix[:1] in ("r", "m") and suffix[1:].isdigit():
        return base, int(suffix[1:])
    return wire, 0


def is_migrated(wire: str) -> bool:
    """Whether ``wire`` is a migrated attempt: its prompt carries output sent before it."""
    base, _ = attempt_of(wire)
    return wire != base and wire[len(base) + 1] == "m"
