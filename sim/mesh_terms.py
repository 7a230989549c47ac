"""What the mesh adds to the engine on a host: ``MeshOverheads`` (with each mode's ``Jitter``),
one type that a device spec holds (``DeviceSpec.mesh``; the JSON's ``mesh`` object) and that
``overheads.py`` fits to a real mesh's probe; a fitted one goes into a spec whole
(``MeshOverheads.apply``), no field copied.

All 0 (and paces of 1) in the GPU specs, where nothing measured them. The terms:

- ``loop_s`` per step of a disagg decode worker's loop (admission, the step's hand-off to its
  thread, metrics) and ``token_s`` per token that step streams (its event's encoding, NATS, the
  router, SSE), both paid on the step's serial part; ``colocated_loop_s`` and
  ``colocated_token_s`` the same for a colocated worker, measured apart (its threads take every
  core, so the router's and NATS's work for each token slows it more);
- ``request_s``: a request's fixed latency outside the engine (HTTP, tokenization, placement,
  the reservation, the first token's way back); ``handoff_s``: what a disaggregated request
  pays on top (the prefill job's dispatch, the last write's completion, PrefillDone, the decode
  worker's admission);
- ``jitter`` and ``colocated_jitter``: how a disagg decode worker's and a colocated worker's
  loop steps jitter and their sequences' paces spread (``Jitter``; ``CostModel.jitter_s`` and
  ``CostModel.pace`` draw from them);
- ``colocated_wake_s`` and ``prefill_wake_s``: what the first step of a colocated or prefill
  worker idle for ``cost.WAKE_AFTER_S`` or longer costs on top (its threads asleep, its caches
  cold: on this 2-core VM a 1,024-token prompt sent to a mesh idle for 0.3-1 s took 25-30 %
  longer than one sent right after the previous request ended);
- ``colocated_warmup_s`` and ``decode_warmup_s``: what a sequence's first decode step after its
  first token adds to a colocated or decode worker's step, tapering to 0 over
  ``cost.WARMUP_STEPS`` steps (on this VM the first gaps of a 500-1,500-token request were
  15-37 % longer than its later ones, the next three 5-22 %).

The pace: on this VM each request decodes at its own steady speed (steady gaps of 1.1-2.9 ms at
batch 1 in one run, not explained by its prompt, by overlap or by idling), which the per-step
jitter cannot give: it is redrawn every step. A sequence draws its pace from its worker's
distribution (``CostModel.pace``) and the steps of a batch of decodes take the mean of their
sequences' paces times what they would otherwise (jitter and warm-up apart). A colocated
worker's jitter is measured apart: its two OpenMP threads share every core with the router and
NATS, so a preempted thread stalls the whole step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.sim.specs import DeviceSpec

PACE_QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)  # where Jitter.pace's knots sit


@dataclass(frozen=True, slots=True)
class Jitter:
    """How a loop step's gap varies at batch 1, from request to request and from step to step.

    Step to step: how far a step's gap exceeds its own request's median gap, at the 90th and
    99th percentiles and at most (seconds: the garbage collector, heartbeats, a process the OS
    runs first, a late read). Request to request: each request's steady gap (the mean of the
    second half of its stream) against the mean over requests, as the paces at
    ``PACE_QUANTILES`` (0, 0.1, 0.5, 0.9, 1) scaled so that the piecewise-linear distribution
    through them has mean 1 (``probe_figures.jitter_of`` measures both). Measured against each
    request's own median, the step jitter leaves out what the pace holds: against the common
    median (before), a slow request's every step was jitter."""

    p90_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0
    pace: tuple[float, ...] = (1.0,) * len(PACE_QUANTILES)

    @property
    def mean_s(self) -> float:
        """The mean of ``CostModel.jitter_s``'s distribution (0 to the median, then linear
        through the 90th and 99th percentiles to the largest)."""
        from kvmesh.sim.cost import jitter_quantiles, quantile_mean  # cost reads the specs

        return quantile_mean(jitter_quantiles(self.p90_s, self.p99_s, self.max_s))


@dataclass(frozen=True, slots=True)
class MeshOverheads:
    """The terms above, grouped by whom they cost."""

    # a disagg decode worker's
    loop_s: float = 0.0
    token_s: float = 0.0
    decode_warmup_s: float = 0.0
    jitter: Jitter = field(default_factory=Jitter)
    # a colocated worker's
    colocated_loop_s: float = 0.0
    colocated_token_s: float = 0.0
    colocated_warmup_s: float = 0.0
    colocated_jitter: Jitter = field(default_factory=Jitter)
    colocated_wake_s: float = 0.0
    # a request's path, and a prefill worker's wake
    request_s: float = 0.0
    handoff_s: float = 0.0
    prefill_wake_s: float = 0.0

    def jitter_of(self, role: str) -> Jitter:
        """A ``role`` (colocated, or decode) worker's jitter."""
        return self.colocated_jitter if role == "colocated" else self.jitter

    def apply(self, device: DeviceSpec) -> DeviceSpec:
        """``device`` with these overheads in place of its own."""
        return dataclasses.replace(device, mesh=self)
