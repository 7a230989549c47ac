"""A prefill worker computes on decode's cores while decode is idle (docs/load.md, Cores).

With ``--cpu-sharing partition`` on a CPU box each pool owns cores of its own, so prefill never
delays a decode step; but while no stream decodes, decode's cores sit idle and a prompt still
prefills on prefill's cores alone. ``--borrow-cpus`` lets a prefill worker take those cores for an
engine step when every decode worker it hears is idle:

- ``DecodeIdleness`` (pure) decides from the decode workers' adverts: each advert heard within
  ``max_age_s`` says nothing runs, and each was heard at least ``settle_s`` after this worker last
  delivered a prompt to that decode worker (the advert then already counts the stream that
  delivery started). A decode worker gains streams from prefill deliveries (and, rarely, from a
  local prefill of a short uncached prompt), so with one prefill worker an idle decode almost
  always stays idle for the whole step; a local prefill, or with several prefill workers a
  stream another delivered, may overlap one step, and the next advert ends the loan.
- ``CoreLoan`` runs one step (in the engine's thread) with the borrowed cores and one more torch
  thread for each, and puts the worker back on its own cores before the step's thread returns,
  so no thread of this worker is left on decode's cores between steps.

Decode advertises the moment it turns idle or busy (as well as every heartbeat), so a loan can
start one advert after the last stream ends, and one that a local prefill on decode (or another
prefill worker's delivery) overlaps ends after the step in hand.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from kvmesh.shared.config.cpu_placement import format_cpu_list

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class HeardLoad:
    """One decode worker's latest advert, as far as a loan cares: when it was heard (this
    process's monotonic clock) and how many streams it was running."""

    worker_id: str
    heard_at: float
    num_running: int


@dataclass(slots=True)
class DecodeIdleness:
    """Whether every decode worker this prefill worker hears is idle now."""

    max_age_s: float = 3.0  # an older advert is a worker gone (or silent): it is not counted
    settle_s: float = 0.25  # a delivery's stream shows in adverts heard this long after it
    _delivered_at: dict[str, float] = field(default_factory=dict)

    def delivered(self, decode_worker_id: str, now: float) -> None:
        """This worker announced a prompt to ``decode_worker_id`` at ``now``."""
        self._delivered_at[decode_worker_id] = now

    def idle(self, heard: Iterable[HeardLoad], now: float) -> bool:
        fresh = [h for h in heard if now - h.heard_at <= self.max_age_s]
        return bool(fresh) and all(
            h.num_running == 0
            and h.heard_at >= self._delivered_at.get(h.worker_id, -math.inf) + self.settle_s
            for h in fresh
        )


def pin_threads(cpus: frozenset[int]) -> None:
    """Set the affinity of every thread of this process (torch's OpenMP threads included)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cpus)


@dataclass(frozen=True, slots=True)
class CoreLoan:
    """``own``: the worker's cores and ``threads`` on them; ``borrowed``: the cores it may add."""

    own: frozenset[int]
    borrowed: frozenset[int]
    threads: int

    def __post_init__(self) -> None:
        if not self.own:
            raise ValueError("--borrow-cpus needs --cpus: the cores the worker owns")
        if not self.borrowed - self.own:
            raise ValueError(
                f"--borrow-cpus {format_cpu_list(self.borrowed)} adds no CPU to --cpus "
                f"{format_cpu_list(self.own)}"
            )

    @property
    def widened_threads(self) -> int:
        return self.threads + len(self.borrowed - self.own)

    def describe(self) -> str:
        return (
            f"borrows CPUs {format_cpu_list(self.borrowed - self.own)} while decode is idle "
            f"({self.widened_threads} threads then)"
        )

    def run(self, widen: bool, step: Callable[[], T]) -> T:
        """``step()`` in this thread, on the borrowed cores too when ``widen``; the worker is
        back on its own cores and threads when it returns (or raises)."""
        if not widen:
            return step()
        import torch  # here: the worker's config imports this module, and torch is heavy

        pin_threads(self.own | self.borrowed)
        torch.set_num_threads(self.widened_threads)
        try:
            return step()
        finally:
            torch.set_num_threads(self.threads)
            pin_threads(self.own)
