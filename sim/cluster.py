"""The discrete-event simulation of a kvmesh cluster: arrivals, placement, steps, KV transfers.

Events are kept in one heap ordered by time (ties: the order they were made, so a run is
deterministic). The request path follows the mesh's:

1. a request reaches placement ``mesh.request_s`` after it was sent (the device spec's
   measured fixed latency of the path outside the engine: HTTP, tokenization, the registry, the
   reservation, the first token's way back), then is placed on the colocated or decode worker
   with the most free KV tokens that can reserve its prompt and output (the kv-registry's placement); when none can,
   it waits in a FIFO placement queue until a reservation is released (overload is queueing);
2. colocated: it waits in that worker's queue for admission into the running batch;
   disagg: it joins the one prefill queue, pulled by whichever prefill worker has a free slot;
3. a prefill worker's chunk, once computed, is sent over that worker's link (one transfer at a
   time, in order) while the next chunk computes (the job holds its prefill slot until its last
   write has landed); ``mesh.handoff_s`` after the last chunk's
   KV has landed (PrefillDone and what it takes), the decode worker admits the sequence between
   its steps (at once if it is idle, else when its step in flight ends): that is when the first
   token is announced, and the sequence decodes from the next step on;
4. every step's tokens are delivered at the step's end; a finished request frees its KV. A decode
   or colocated step also pays its loop's overheads (``CostModel.loop_step``, with a jitter
   drawn by a seeded generator) and starts at most every ``decode_pacing_s``; a step of decodes
   only costs the mean of its sequences' paces times that, jitter and warm-up apart (each
   sequence's pace is ``CostModel.pace`` at a quantile of a golden-ratio sequence over the
   requests: even coverage of the distribution however few they are, the same every run). A colocated or
   prefill worker's first step after it has idled ``cost.WAKE_AFTER_S`` or longer pays its wake
   term (``DeviceSpec.wake_s``) on top; ``simulate(..., wake=False)`` leaves it out, for a
   workload sent back to back (each request once the previous one has ended), as the
   calibration probe's phases are.

Steps of workers on one device (``Topology.shared_device``) share it while busy: its cores by
thread count and niceness, each worker at the pace of its slowest thread (``sharing.py``).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord, Slo, Summary, summarize
from kvmesh.sim.cost import WAKE_AFTER_S, CostModel, StepCost
from kvmesh.sim.engine_timings import EngineTimings
from kvmesh.sim.sharing import Share, SharedHost
from kvmesh.sim.topology import Topology
from kvmesh.sim.worker import SimSeq, Work, Worker
from kvmesh.sim.workload import SimRequest

_ARRIVAL, _STEP_DONE, _KV_LANDED, _WAKE, _JOB_SENT = range(5)
GOLDEN = (math.sqrt(5) - 1) / 2


def pace_quantile(index: int) -> float:
    """The quantile of request ``index``'s pace: 0.5, then the golden-ratio sequence's next
    points, so that any run of consecutive requests covers [0, 1) evenly."""
    return (0.5 + index * GOLDEN) % 1.0


@dataclass(frozen=True, slots=True)
class SimResult:
    topology: Topology
    records: tuple[RequestRecord, ...]
    summary: Summary
    prefill_busy: float  # mean fraction of the run a prefill worker computed (0 for colocated)
    decode_busy: float  # the same for decode (or colocated) workers
    mean_decode_batch: float  # decode tokens per step of decode (or colocated) workers
    timings: EngineTimings | None = None  # the engines' means, as the mesh's /metrics count them


class Cluster:
    """One run: ``Cluster(topology, cost, requests).run(slo)``."""

    def __init__(
        self,
        topology: Topology,
        cost: CostModel,
        requests: Sequence[SimRequest],
        wake: bool = True,
    ) -> None:
        assert cost.tp == topology.tp
        self.wake = wake
        self.topology = topology
        self.cost = cost
        self.requests = list(requests)
        capacity = topology.kv_capacity_tokens or cost.kv_capacity_tokens()
        t = topology
        home_role = "colocated" if t.mode == "colocated" else "decode"
        self.homes = [
            Worker(
                i,
                home_role,
                chunk_tokens=t.chunk_tokens,
                max_num_seqs=t.max_num_seqs,
                kv_capacity=capacity,
                no_decode_tokens=t.no_decode_chunk_tokens if t.mode == "colocated" else 0,
            )
            for i in range(t.num_decode)
        ]
        self.prefills = [
            Worker(
                t.num_decode + i,
                "prefill",
                chunk_tokens=t.chunk_tokens,
                max_num_seqs=t.max_prefill_jobs,
                max_jobs=t.max_prefill_jobs,
                block_tokens=t.block_tokens,
            )
            for i in range(t.num_prefill)
        ]
        self.workers = self.homes + self.prefills
        self.prefill_queue: deque[SimSeq] = deque()
        self.placement_queue: deque[SimSeq] = deque()
        self.link_free = [0.0] * len(self.workers)
        self.batches: dict[int, list[Work]] = {}
        self.versions = [0] * len(self.workers)
        self.step_start = [0.0] * len(self.workers)
        self.idle_since = [-math.inf] * len(self.workers)  # when each one's last step ended
        self.engine_share = [1.0] * len(self.workers)  # of the step in flight: engine / loop step
        self.step_walls = {"home": [0, 0.0], "prefill": [0, 0.0]}  # steps, engine wall seconds
        self.queued_at: dict[int, float] = {}  # a disagg sequence's entry into the prefill queue
        self.queue_waits: list[float] = []
        d = cost.device
        if t.shared_device:
            host = SharedHost(d.cores, d.calibration_threads)
            self.devices = dict.fromkeys((w.index for w in self.workers), host)
        else:
            self.devices = {w.index: SharedHost() for w in self.workers}
        self.shares = {w.index: self._share(w.role) for w in self.workers}
        self.seqs = [
            SimSeq(
                i,
                r.arrival_s,
                r.input_len,
                r.output_len,
                pace=cost.pace(pace_quantile(i), home_role),
            )
            for i, r in enumerate(self.requests)
        ]
        self.errors: dict[int, str] = {}
        self._jitter = random.Random(0)  # loop steps' jitter: the same draws every run
        self._events: list[tuple[float, int, int, int, int]] = []
        self._counter = itertools.count()

    def _share(self, role: str) -> Share:
        t, cores = self.topology, self.cost.device.cores
        if not t.shared_device:
            return Share(1)
        if role == "prefill":
            return Share(t.prefill_threads or cores, t.prefill_nice)
        return Share(t.decode_threads or cores)

    def _push(self, time: float, kind: int, who: int, version: int = 0) -> None:
        heapq.heappush(self._events, (time, next(self._counter), kind, who, version))

    def run(self, slo: Slo | None = None) -> SimResult:
        delay = self.cost.device.mesh.request_s
        for s in self.seqs:
            self._push(s.arrival_s + delay, _ARRIVAL, s.index)
        now = 0.0
        while self._events:
            now, _, kind, who, version = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._place(self.seqs[who], now)
            elif kind == _STEP_DONE and version == self.versions[who]:
                self._step_done(self.workers[who], now)
            elif kind == _KV_LANDED:
                self._kv_landed(self.seqs[who], now)
            elif kind == _WAKE:
                self._kick(self.workers[who], now)
            elif kind == _JOB_SENT:
                self.workers[who].job_sent()
                self._kick(self.workers[who], now)
        assert not self.placement_queue and not self.prefill_queue
        assert all(not w.running and not w.waiting for w in self.workers)
        return self._result(slo)

    # ---- placement ----

    def _place(self, seq: SimSeq, now: float) -> None:
        if seq.kv_tokens > self.homes[0].kv_capacity:
            self.errors[seq.index] = "too_long"  # the router's 400: it can never fit
            return
        if self.placement_queue or not self._try_place(seq, now):
            self.placement_queue.append(seq)

    def _try_place(self, seq: SimSeq, now: float) -> bool:
        home = max(self.homes, key=lambda w: (w.kv_free, -w.index))
        if not home.can_reserve(seq):
            return False
        home.reserve(seq)
        if self.topology.mode == "colocated":
            home.waiting.append(seq)
            self._kick(home, now)
        else:
            self.prefill_queue.append(seq)
            self.queued_at[seq.index] = now
            for p in self.prefills:
                if not p.is_busy:
                    self._kick(p, now)
        return True

    def _drain_placements(self, now: float) -> None:
        while self.placement_queue and self._try_place(self.placement_queue[0], now):
            self.placement_queue.popleft()

    # ---- steps ----

    def _kick(self, worker: Worker, now: float) -> None:
        if worker.is_busy:
            return
        pacing = self.topology.decode_pacing_s if worker.role != "prefill" else 0.0
        start = worker.last_step_start + pacing
        if start > now + 1e-12:
            if worker.waiting or worker.running:
                self._push(start, _WAKE, worker.index)
            return
        if worker.role == "decode":
            self._admit_prefilled(worker, now)
        batch = worker.plan(self.prefill_queue if worker.role == "prefill" else None)
        if not batch:
            return
        slices, d = [w.slice() for w in batch], self.cost.device
        pace = 1.0 if worker.role == "prefill" else _pace(batch)
        engine_step = self.cost.step(slices, worker.role)
        if worker.role == "prefill":
            step = engine_step
            self.queue_waits += [
                now - self.queued_at[w.seq.index] for w in batch if w.seq.num_computed == 0
            ]
        else:
            jitter = (
                self.cost.jitter_s(self._jitter.random(), worker.role)
                if d.jitter_knots(worker.role)[2] > 0
                else 0.0
            )
            step = self.cost.loop_step(
                slices,
                sum(w.emits_token for w in batch),
                is_colocated=worker.role == "colocated",
                engine=engine_step,
            )
            overhead = step.overhead_s * pace + jitter
            if d.warmup_s(worker.role) > 0:  # sequences in their first decode steps
                overhead += sum(
                    self.cost.warmup_s(worker.role, len(w.seq.token_times) - 1)
                    for w in batch
                    if not w.is_prefill
                )
            step = StepCost(step.flops, step.bytes, overhead, step.roofline_s * pace)
        engine = engine_step.seconds * pace
        wake = d.wake_s(worker.role)
        if self.wake and wake > 0 and now - self.idle_since[worker.index] >= WAKE_AFTER_S:
            step = StepCost(step.flops, step.bytes, step.overhead_s + wake, step.roofline_s)
            engine += wake
        self.engine_share[worker.index] = engine / step.seconds if step.seconds > 0 else 1.0
        worker.is_busy = True
        worker.last_step_start = now
        worker.busy_s += step.seconds
        self.batches[worker.index] = batch
        self.step_start[worker.index] = now
        # a dedicated device runs the step as one piece (rate 1): its end is now + seconds
        parts = (
            (step.overhead_s, step.roofline_s)
            if self.topology.shared_device
            else (0.0, step.seconds)
        )
        share = self.shares[worker.index]
        self._reschedule(self.devices[worker.index].start(worker.index, share, *parts, now))

    def _reschedule(self, finish_times: dict[int, float]) -> None:
        for index, at in finish_times.items():
            self.versions[index] += 1
            self._push(at, _STEP_DONE, index, self.versions[index])

    def _step_done(self, worker: Worker, now: float) -> None:
        done, finish_times = self.devices[worker.index].phase_done(worker.index, now)
        self._reschedule(finish_times)
        if not done:  # its overhead is over; its roofline part now runs on its threads
            return
        worker.is_busy = False
        self.idle_since[worker.index] = now
        batch = self.batches.pop(worker.index)
        walls = self.step_walls["prefill" if worker.role == "prefill" else "home"]
        walls[0] += 1
        walls[1] += (now - self.step_start[worker.index]) * self.engine_share[worker.index]
        outcome = worker.complete(batch, now)
        if worker.role == "prefill":
            self._send_chunks(worker, now, batch, {s.index for s in outcome.prefilled})
        if outcome.finished:
            self._drain_placements(now)
        self._kick(worker, now)
        if worker.role == "prefill":
            for p in self.prefills:  # a free slot elsewhere may take what this one left queued
                self._kick(p, now)

    def _send_chunks(
        self, worker: Worker, now: float, batch: list[Work], prefilled: set[int]
    ) -> None:
        # every chunk of this step goes out on the worker's link, one transfer after another,
        # while the worker computes its next chunk
        for w in batch:
            start = max(now, self.link_free[worker.index])
            self.link_free[worker.index] = start + self.cost.transfer_seconds(w.num_new)
            if w.seq.index in prefilled:
                landed = self.link_free[worker.index]
                self._push(landed, _JOB_SENT, worker.index)
                self._push(landed + self.cost.device.mesh.handoff_s, _KV_LANDED, w.seq.index)

    def _kv_landed(self, seq: SimSeq, now: float) -> None:
        home = self.homes[seq.home]
        home.waiting.append(seq)
        self._kick(home, now)

    def _admit_prefilled(self, worker: Worker, now: float) -> None:
        """Between steps, the decode worker admits the sequences whose KV has landed: each one's
        first token (the prefill's sample) is announced now."""
        for seq in [s for s in worker.waiting if not s.token_times]:
            seq.token_times.append(now)
            if seq.is_finished:
                worker.waiting.remove(seq)
                worker.release(seq)
                self._drain_placements(now)

    # ---- results ----

    def _result(self, slo: Slo | None) -> SimResult:
        records = []
        for s in self.seqs:
            error = self.errors.get(s.index)
            times = tuple(s.token_times)
            records.append(
                RequestRecord(
                    index=s.index,
                    arrival_s=s.arrival_s,
                    send_s=s.arrival_s,
                    end_s=times[-1] if times else s.arrival_s,
                    prompt_len=s.prompt_len,
                    output_len=s.output_len,
                    num_output_tokens=len(times),
                    chunk_times=times,
                    error=error,
                )
            )
        start = min((s.arrival_s for s in self.seqs), default=0.0)
        end = max((r.end_s for r in records), default=0.0)
        summary = summarize(records, max(end - start, 1e-9), slo)
        duration = max(end - start, 1e-9)

        def busy(workers: list[Worker]) -> float:
            return sum(w.busy_s for w in workers) / (len(workers) * duration) if workers else 0.0

        steps = sum(w.num_steps for w in self.homes)
        home_steps, home_s = self.step_walls["home"]
        chunks, chunk_s = self.step_walls["prefill"]
        waits = self.queue_waits
        timings = EngineTimings(
            home_steps,
            home_s / home_steps if home_steps else None,
            chunks,
            chunk_s / chunks if chunks else None,
            len(waits),
            sum(waits) / len(waits) if waits else None,
        )
        return SimResult(
            topology=self.topology,
            records=tuple(records),
            summary=summary,
            prefill_busy=busy(self.prefills),
            decode_busy=busy(self.homes),
            mean_decode_batch=sum(w.num_decodes for w in self.homes) / steps if steps else 0.0,
            timings=timings,
        )


def simulate(
    topology: Topology,
    cost: CostModel,
    requests: Sequence[SimRequest],
    slo: Slo | None = None,
    wake: bool = True,
) -> SimResult:
    """Run ``requests`` on ``topology``; ``wake=False``: no worker pays its wake term (the
    requests were sent back to back, the mesh never idle between them)."""
    return Cluster(topology, cost, requests, wake).run(slo)


def _pace(batch: Sequence[Work]) -> float:
    """A step's pace: the mean of its sequences' (a step of decodes only); 1 for a step that
    also prefills (its chunk's cost is the prompt's, not a sequence's pace)."""
    if any(w.is_prefill for w in batch):
        return 1.0
    return sum(w.seq.pace for w in batch) / len(batch)
