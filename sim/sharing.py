"""How workers on one shared host divide its cores while busy (a mesh on one CPU machine).

Each busy worker's step has two phases, run in order (``cost.StepCost``):

1. the overhead: Python, dispatch, sampling, on one thread (its time was measured on a core);
2. the roofline part: on the worker's ``threads`` OpenMP threads (measured with the spec's
   ``calibration_threads``; with ``c`` cores it runs at ``c / calibration_threads`` of that).

At each moment the runnable threads (1 for a worker in phase 1, ``min(threads, cores)`` in
phase 2) are placed on the cores as the kernel's load balancer does: heaviest first, each on
the core with the least weight so far. On a core, threads share time by CFS weight
(``1024 / 1.25 ** nice``). A worker's OpenMP threads meet at barriers, so the worker advances
at the pace of its slowest thread: its cores are ``threads * min(share)`` (the gang effect
docs/load.md measured: a two-thread prefill beside a one-thread decode ran at half speed).

Not modelled: OpenMP threads spinning while they wait (``OMP_WAIT_POLICY``), cache and memory
bandwidth contention between workers, other processes on the machine.

With one core and one thread per worker, this is plain processor sharing: k busy workers each
run at 1/k speed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Share:
    """A worker's claim on the host: its torch threads and its niceness."""

    threads: int
    nice: int = 0

    def __post_init__(self) -> None:
        assert self.threads >= 1 and 0 <= self.nice <= 19, self

    @property
    def weight(self) -> float:
        return 1024 / 1.25**self.nice  # the kernel's sched_prio_to_weight, to within 1 %


@dataclass(slots=True)
class _Busy:
    share: Share
    phases: list[float]  # remaining seconds (at full speed) of [overhead, roofline]

    @property
    def phase(self) -> int:
        return 0 if self.phases[0] > 0 else 1


_MAX_CACHED_STATES = 4096


class SharedHost:
    """Busy workers' remaining work and when each one's current phase ends."""

    def __init__(self, cores: int = 1, calibration_threads: int = 1) -> None:
        assert cores >= 1 and calibration_threads >= 1
        self.cores = cores
        self.calibration_threads = calibration_threads
        self.busy: dict[int, _Busy] = {}
        self.updated = 0.0
        # rates depend only on who is busy, with which share, in which phase: a run revisits
        # a handful of such states hundreds of thousands of times
        self._rates: dict[tuple[tuple[int, Share, int], ...], dict[int, float]] = {}

    def rates(self) -> dict[int, float]:
        """Speed of each busy worker's current phase (1 = as fast as calibrated). Read-only:
        the same dict is handed out again for the same state."""
        key = tuple((w, b.share, b.phase) for w, b in self.busy.items())
        cached = self._rates.get(key)
        if cached is None:
            if len(self._rates) >= _MAX_CACHED_STATES:
                self._rates.clear()
            cached = self._rates[key] = self._placed_rates()
        return cached

    def _placed_rates(self) -> dict[int, float]:
        threads: list[tuple[float, int]] = []  # (weight, worker) for every runnable thread
        for w, b in self.busy.items():
            n = 1 if b.phase == 0 else min(b.share.threads, self.cores)
            threads += [(b.share.weight, w)] * n
        load = [0.0] * self.cores
        placed: list[tuple[int, int, float]] = []  # (worker, core, weight)
        for weight, w in sorted(threads, key=lambda t: (-t[0], t[1])):
            core = min(range(self.cores), key=lambda c: (load[c], c))
            load[core] += weight
            placed.append((w, core, weight))
        slowest: dict[int, float] = {}
        count: dict[int, int] = {}
        for w, core, weight in placed:
            slowest[w] = min(slowest.get(w, 1.0), weight / load[core])
            count[w] = count.get(w, 0) + 1
        out = {}
        for w, b in self.busy.items():
            cores = count[w] * slowest[w]
            out[w] = min(cores, 1.0) if b.phase == 0 else cores / self.calibration_threads
        return out

    def _advance(self, now: float) -> None:
        for w, rate in self.rates().items():
            b = self.busy[w]
            b.phases[b.phase] = max(0.0, b.phases[b.phase] - (now - self.updated) * rate)
        self.updated = now

    def finish_times(self, now: float) -> dict[int, float]:
        """When each busy worker's current phase ends, if nothing changes before."""
        rates = self.rates()
        return {w: now + b.phases[b.phase] / rates[w] for w, b in self.busy.items()}

    def start(
        self, worker: int, share: Share, overhead_s: float, roofline_s: float, now: float
    ) -> dict[int, float]:
        self._advance(now)
        self.busy[worker] = _Busy(share, [overhead_s, roofline_s])
        if overhead_s <= 0 and roofline_s <= 0:
            self.busy[worker].phases[1] = 0.0
        return self.finish_times(now)

    def phase_done(self, worker: int, now: float) -> tuple[bool, dict[int, float]]:
        """``worker``'s current phase ended at ``now``: whether its step is done, and the new
        phase ends of the busy workers."""
        b = self.busy[worker]
        phase = b.phase  # the one that was running; advancing may drain it to 0
        self._advance(now)
        if phase == 0 and b.phases[1] > 0:
            b.phases[0] = 0.0  # float residue: the event said the phase is over
            return False, self.finish_times(now)
        del self.busy[worker]
        return True, self.finish_times(now)
