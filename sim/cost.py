"""Roofline cost of one engine step, from a model's shape and a device's peaks (pure arithmetic).

A step runs a batch of *slices*: each is ``num_new`` tokens of one sequence whose first
``context`` tokens are already in the KV cache (a decode is ``num_new = 1``; a prefill chunk is
any ``num_new``). For a step:

- FLOPs = 2 * layer params * new tokens (the matmuls)
  + 4 * layers * heads * head_dim * (attended pairs): new token ``i`` of a slice attends to
  ``context + i + 1`` positions, once for QK^T and once for PV (causal, so a slice has
  ``num_new * context + num_new * (num_new + 1) / 2`` pairs)
  + 2 * hidden * vocab per slice (the LM head, on each slice's last token only);
- bytes = the weights once, when they do not fit in the device's last-level cache
  (``cache_bytes``; a 14 MB model stays in a CPU's 32 MB LLC, an 8B model streams from HBM every
  step) + each slice's cached KV read once (``context`` tokens) + its new tokens' KV written.
  Activations are left out: they are small beside weights and KV at serving batch sizes;
- time = overhead + max(FLOPs / effective FLOP/s, bytes / effective bandwidth), where the
  overhead is the fixed part a calibration measures: ``step_overhead_s`` per step +
  ``seq_overhead_s`` per slice + ``chunk_overhead_s`` per prefill chunk (``num_new > 1``);
  on a device whose attention runs as a phase of its own (``DeviceSpec.attention_flops``: a
  calibrated CPU), the roofline is the matmuls' (their FLOPs and the LM head's, the weights'
  bytes) plus the attention's (its FLOPs at ``attention_flops``, the KV's bytes at
  ``attention_bandwidth``): the two phases run one after the other, each at its own limit;
- a step of a mesh worker (``step(slices, role)``) is that times the device's
  ``engine_scale(role)``, plus its ``engine_extra_s(role)`` on the overhead (a colocated or
  decode worker's stall per step): the engine inside a mesh worker process, measured by calibration's
  probe, is slower than the in-process calibration the figures come from (``engine_scale.py``).

The two parts are kept apart (``StepCost.overhead_s``, ``StepCost.roofline_s``): on a CPU host
shared by several workers the overhead is serial (one core's Python and dispatch) while the
roofline part runs on all of a worker's threads (``sharing.py``).

A decode or colocated worker's step, as the mesh runs it (``loop_step``), also pays its loop's
fixed cost and each streamed token's (the spec's ``mesh.loop_s``, ``mesh.token_s``: measured by
calibration on a real mesh, ``overheads.py``), on the serial part, and a jitter drawn from the
measured distribution of that role (``jitter_s``). Each sequence decodes at its own pace
(``pace``, drawn once per sequence from the role's measured distribution, of mean 1): a step of
decodes takes the mean of its sequences' paces times the rest of its cost.

A worker of ``tp`` devices (tensor parallel) has ``tp`` times the FLOP/s and bandwidth; the
all-reduces between them are not modelled. KV transfers take ``bytes / link bandwidth +
latency`` on the prefill worker's link.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.sim.mesh_terms import PACE_QUANTILES
from kvmesh.sim.specs import DeviceSpec, ModelSpec

WAKE_AFTER_S = 0.2  # a worker idle this long pays its wake term on its next step
WARMUP_STEPS = 4  # a sequence's first decode steps pay its role's warm-up term, tapering


def warmup_taper(decode_step: int) -> float:
    """The share of its role's warm-up term a sequence's ``decode_step``-th decode step (0: the
    first after its first token) pays: 1, falling linearly to 0 over ``WARMUP_STEPS`` steps."""
    assert decode_step >= 0, decode_step
    return max(0.0, 1.0 - decode_step / WARMUP_STEPS)


@dataclass(frozen=True, slots=True)
class Slice:
    """``num_new`` tokens of one sequence computed in a step, after ``context`` cached ones."""

    num_new: int
    context: int

    def __post_init__(self) -> None:
        assert self.num_new >= 1 and self.context >= 0, self


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float
    overhead_s: float  # fixed costs: per step, per sequence, per prefill chunk
    roofline_s: float  # max(compute, memory), per phase where the device splits them

    @property
    def seconds(self) -> float:
        return self.overhead_s + self.roofline_s


@dataclass(frozen=True, slots=True)
class CostModel:
    model: ModelSpec
    device: DeviceSpec
    tp: int = 1

    def __post_init__(self) -> None:
        assert self.tp >= 1

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def kv_capacity_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV a worker holds: its share of device memory less the weights."""
        free = self.device.memory_bytes * self.tp * memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"{self.model.name} ({self.model.weight_bytes / 1e9:.1f} GB of weights) does not "
                f"fit {self.tp} x {self.device.name}; raise tp"
            )
        return int(free // self.kv_bytes_per_token)

    def step_flops(self, slices: Iterable[Slice]) -> float:
        return sum(self.phase_flops(slices))

    def phase_flops(self, slices: Iterable[Slice]) -> tuple[float, float]:
        """A step's FLOPs as (the matmuls' with the LM head's, the attention's)."""
        m = self.model
        new_tokens = pairs = heads_out = 0
        for s in slices:
            new_tokens += s.num_new
            pairs += s.num_new * s.context + s.num_new * (s.num_new + 1) // 2
            heads_out += 1
        linear = 2 * m.num_layers * m.layer_params * new_tokens
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * pairs
        lm_head = 2 * m.lm_head_params * heads_out
        return float(linear + lm_head), float(attention)

    @property
    def weights_resident(self) -> bool:
        """Whether each device's share of the weights fits in its last-level cache."""
        return self.model.weight_bytes / self.tp <= self.device.cache_bytes

    def step_bytes(self, slices: Iterable[Slice]) -> float:
        """Bytes a step moves to or from memory: weights (unless cached) and KV."""
        return sum(self.phase_bytes(slices))

    def phase_bytes(self, slices: Iterable[Slice]) -> tuple[float, float]:
        """A step's memory traffic as (the weights', unless cached; the KV's)."""
        kv_tokens = sum(s.context + s.num_new for s in slices)
        weights = 0 if self.weights_resident else self.model.weight_bytes
        return float(weights), float(kv_tokens * self.kv_bytes_per_token)

    def roofline_s(self, slices: Sequence[Slice]) -> float:
        """The step's time at the device's limits (no overhead, no role): one roofline over
        all its work, or the matmuls' and the attention's one after the other on a device that
        runs attention as a phase of its own."""
        d = self.device
        flops, bandwidth = d.effective_flops * self.tp, d.effective_bandwidth * self.tp
        (matmul_flops, attention_flops) = self.phase_flops(slices)
        weight_bytes, kv_bytes = self.phase_bytes(slices)
        if d.attention_flops <= 0:
            return max(
                (matmul_flops + attention_flops) / flops, (weight_bytes + kv_bytes) / bandwidth
            )
        matmuls = max(matmul_flops / flops, weight_bytes / bandwidth)
        attention = max(
            attention_flops / (d.attention_flops * self.tp),
            kv_bytes / (d.attention_bandwidth * self.tp),
        )
        return matmuls + attention

    def step_overhead_s(self, slices: Iterable[Slice]) -> float:
        d = self.device
        num_slices = num_chunks = 0
        for s in slices:
            num_slices += 1
            num_chunks += s.num_new > 1
        return d.step_overhead_s + d.seq_overhead_s * num_slices + d.chunk_overhead_s * num_chunks

    def step(self, slices: Iterable[Slice], role: str | None = None) -> StepCost:
        """The engine's step; with ``role``, as a worker of that role runs it in the mesh (its
        overhead and roofline times the device's ``engine_scale(role)``, and its
        ``engine_extra_s(role)`` added to the overhead)."""
        slices = list(slices)
        assert slices, "a step computes something"
        flops, num_bytes = self.step_flops(slices), self.step_bytes(slices)
        scale = 1.0 if role is None else self.device.engine_scale(role)
        extra = 0.0 if role is None else self.device.engine_extra_s(role)
        overhead = self.step_overhead_s(slices) * scale + extra
        return StepCost(flops, num_bytes, overhead, self.roofline_s(slices) * scale)

    def loop_step(
        self,
        slices: Iterable[Slice],
        num_tokens: int,
        *,
        is_colocated: bool = False,
        engine: StepCost | None = None,
    ) -> StepCost:
        """A decode (or, ``is_colocated``, colocated) worker's step in the mesh: the engine's
        step, plus the loop's fixed cost and ``num_tokens`` streamed tokens' cost, serial (one
        thread). The engine's part is scaled by the role's ``engine_scale``; the loop's is not.
        The simulator scales the whole by the step's pace and adds a ``jitter_s(u)`` draw.
        ``engine``: the engine's step of these slices for that role, when the caller has it."""
        assert num_tokens >= 0
        role = "colocated" if is_colocated else "decode"
        step = engine if engine is not None else self.step(slices, role)
        m = self.device.mesh
        if is_colocated:
            loop = m.colocated_loop_s + m.colocated_token_s * num_tokens
        else:
            loop = m.loop_s + m.token_s * num_tokens
        return StepCost(step.flops, step.bytes, step.overhead_s + loop, step.roofline_s)

    def warmup_s(self, role: str, decode_step: int) -> float:
        """What a sequence's ``decode_step``-th decode step (0: the first after its first
        token) adds to a ``role`` worker's step: the role's warm-up term, tapering linearly to
        0 over ``WARMUP_STEPS`` steps."""
        return self.device.warmup_s(role) * warmup_taper(decode_step)

    def jitter_s(self, u: float, role: str = "decode") -> float:
        """A ``role`` (decode or colocated) worker's loop step jitter at quantile ``u`` in
        [0, 1): 0 up to the median, then linear through the p90 excess at 0.9 and the p99 excess
        at 0.99 to the largest (``DeviceSpec.jitter_knots``)."""
        return _piecewise(jitter_quantiles(*self.device.jitter_knots(role)), u)

    def pace(self, u: float, role: str = "decode") -> float:
        """A ``role`` (decode or colocated) worker's sequence's pace at quantile ``u`` in
        [0, 1]: linear between the knots of ``DeviceSpec.pace_knots`` (1 without a measured
        spread)."""
        return _piecewise(pace_quantiles(self.device.pace_knots(role)), u)

    def step_seconds(self, slices: Iterable[Slice]) -> float:
        return self.step(slices).seconds

    def transfer_seconds(self, num_tokens: int) -> float:
        """Time to move ``num_tokens`` tokens of KV over one worker's link."""
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.device.link_latency_s + num_bytes / (self.device.link_bandwidth * self.tp)


Knots = tuple[tuple[float, float], ...]  # (quantile, value), quantiles rising from 0 to 1


def jitter_quantiles(p90_s: float, p99_s: float, max_s: float) -> Knots:
    """The step jitter's quantile function: 0 up to the median, then linear through the p90
    excess at 0.9 and the p99 excess at 0.99 to the largest."""
    return ((0.0, 0.0), (0.5, 0.0), (0.9, p90_s), (0.99, p99_s), (1.0, max_s))


def pace_quantiles(knots: Sequence[float]) -> Knots:
    """The pace's quantile function: linear through ``knots`` at ``PACE_QUANTILES``."""
    return tuple(zip(PACE_QUANTILES, knots, strict=True))


def quantile_mean(knots: Knots) -> float:
    """The mean of the distribution whose quantile function is the line through ``knots``
    (from quantile 0 to 1): the integral of that line."""
    return sum((u1 - u0) * (x0 + x1) / 2 for (u0, x0), (u1, x1) in itertools.pairwise(knots))


def _piecewise(knots: Knots, u: float) -> float:
    """The value at ``u`` of the line through ``knots`` ((quantile, value), quantiles rising):
    the first knot's value below it, the last one's above."""
    if u <= knots[0][0]:
        return knots[0][1]
    for (u0, x0), (u1, x1) in itertools.pairwise(knots):
        if u <= u1:
            return x0 + (x1 - x0) * (u - u0) / (u1 - u0)
    return knots[-1][1]
