"""Fit a device's cost figures to measured step times (pure; ``calibrate.py`` measures).

The cost model (``cost.py``) gives a step ``overhead + max(FLOPs / F, bytes / B)`` with the
overhead ``s`` per step, ``q`` per sequence and ``c`` per prefill chunk. From

- decode steps at several batch sizes and contexts: ``t = s + q * batch + max(FLOPs / F,
  bytes / B)``, and
- whole-prompt prefills at several lengths: ``t = (s + q + c) + FLOPs / F`` (compute-bound),

the prefill points give ``F`` and the per-chunk intercept by least squares; the decode points
then give ``s``, ``q`` and ``B`` (linear least squares in ``s``, ``q`` for each ``B`` on a log
grid, keeping the best). Errors are relative (each point weighted by ``1 / t``), so a 2 ms step
counts as much as a 100 ms one. ``q`` is kept only where the data show it (``q > 0``).

A fit that contradicts the data is refused with ``FitError`` rather than written: a rate that
does not grow with work, or a zero or negative overhead where the steps plainly take time that
the roofline does not explain, or a point the best fit misses by more than 50 %. Small negative
intercepts within noise are set to 0, with a note.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.sim.cost import CostModel, Slice
from kvmesh.sim.specs import DeviceSpec, ModelSpec

_BANDWIDTH_GRID = (1e7, 1e14)  # bytes/s searched for the decode fit
MAX_RELATIVE_ERROR = 0.5  # a point the fit misses by more is refused, not written
ATTENTION_APART = 1.5  # attention this many times slower per FLOP than the matmuls: its own phase


class FitError(ValueError):
    """Measured points that the cost model cannot describe with plausible figures."""


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """Median decode step time at ``batch`` sequences of ``context`` cached tokens each."""

    batch: int
    context: int
    seconds: float

    @property
    def label(self) -> str:
        return f"decode batch {self.batch} x {self.context}"


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    """Time of one prefill step of ``tokens`` new tokens after ``context`` cached ones (0: a
    whole prompt in one step; more: a later chunk of a chunked prefill, as the mesh runs them)."""

    tokens: int
    seconds: float
    context: int = 0

    @property
    def label(self) -> str:
        after = f" after {self.context}" if self.context else ""
        return f"prefill {self.tokens}{after}"


@dataclass(frozen=True, slots=True)
class Residual:
    label: str
    measured_s: float
    predicted_s: float

    @property
    def relative(self) -> float:
        return self.predicted_s / self.measured_s - 1


@dataclass(frozen=True, slots=True)
class Fit:
    flops: float  # effective FLOP/s
    bandwidth: float  # effective bytes/s
    step_overhead_s: float
    seq_overhead_s: float
    chunk_overhead_s: float
    residuals: tuple[Residual, ...]
    notes: tuple[str, ...]
    attention_flops: float = 0.0  # > 0: attention a phase of its own (DeviceSpec's fields)
    attention_bandwidth: float = 0.0

    @property
    def max_relative_error(self) -> float:
        return max(abs(r.relative) for r in self.residuals)


def fit_costs(
    model: ModelSpec,
    cache_bytes: float,
    decode: Sequence[DecodePoint],
    prefill: Sequence[PrefillPoint],
) -> Fit:
    if len({p.tokens for p in prefill}) < 2:
        raise FitError("the fit needs prefills of at least two lengths")
    if len({(p.batch, p.context) for p in decode}) < 3:
        raise FitError("the fit needs decode steps at three or more (batch, context) shapes")
    if any(p.seconds <= 0 for p in (*decode, *prefill)):
        raise FitError("a measured time is not positive")
    counts = CostModel(model, _device(1.0, 1.0, cache_bytes))
    notes: list[str] = []
    a, flops, attention_flops = _fit_prefill_rates(counts, prefill)

    # decode: t = s + q * batch + roofline(B[, B_attention]), the bandwidths on log grids
    slices = [[Slice(1, p.context)] * p.batch for p in decode]
    td = [p.seconds for p in decode]

    def roofs(bandwidth: float, attention_bandwidth: float) -> list[float]:
        device = _device(
            flops, bandwidth, cache_bytes, attention=(attention_flops, attention_bandwidth)
        )
        cost = CostModel(model, device)
        return [cost.roofline_s(sl) for sl in slices]

    def solve(bandwidths: tuple[float, float]) -> tuple[float, float, float]:
        roof = roofs(*bandwidths)
        y = [ti - r for ti, r in zip(td, roof, strict=True)]
        s, q = _weighted_lstsq([[1.0, float(p.batch)] for p in decode], y, td)
        if q < 0:  # the data do not show a per-sequence cost
            (s,) = _weighted_lstsq([[1.0] for _ in decode], y, td)
            q = 0.0
        if s < 0:  # a bandwidth so low that the weights' read outgrows the steps: no overhead
            s, (q,) = 0.0, _weighted_lstsq([[float(p.batch)] for p in decode], y, td)
            q = max(q, 0.0)
        pred = [s + q * p.batch + r for p, r in zip(decode, roof, strict=True)]
        return sum(((pi - ti) / ti) ** 2 for pi, ti in zip(pred, td, strict=True)), s, q

    bandwidth, attention_bandwidth = _grid_search(lambda b: solve(b)[0], split=attention_flops > 0)
    _, s, q = solve((bandwidth, attention_bandwidth))
    if bandwidth >= _BANDWIDTH_GRID[1] / 1.1:
        notes.append(
            "the memory term never binds on these points: bandwidth is the search's upper bound"
        )
    if attention_flops > 0:
        notes.append(
            f"attention runs as a phase of its own: {attention_flops / 1e9:.1f} GFLOP/s against "
            f"the matmuls' {flops / 1e9:.1f}, its KV read at {attention_bandwidth / 1e9:.1f} GB/s"
        )

    # plausibility: the batch-1 steps take time the roofline does not explain -> overhead > 0
    smallest = min(decode, key=lambda p: (p.batch, p.context))
    roof_small = roofs(bandwidth, attention_bandwidth)[decode.index(smallest)]
    if s <= 0:
        if smallest.seconds > 2 * roof_small:
            raise FitError(
                f"the fitted per-step overhead is {s * 1e3:.2f} ms, yet a {smallest.label} step "
                f"took {smallest.seconds * 1e3:.2f} ms of which the roofline explains "
                f"{roof_small * 1e3:.2f} ms: the points do not fit overhead + roofline (a busy "
                "machine, or steps the cost model does not describe); not writing this spec"
            )
        notes.append(f"per-step overhead {s * 1e3:.2f} ms within noise of 0: set to 0")
        s = 0.0
    shortest = min(prefill, key=lambda p: (p.tokens, p.context))
    if a < -0.05 * shortest.seconds:
        raise FitError(
            f"the prefill intercept is {a * 1e3:.2f} ms (negative beyond noise): prefill time is "
            "not fixed cost + FLOPs / rate on these points; not writing this spec"
        )
    chunk = a - s - q
    if chunk < 0:
        notes.append(
            f"prefill's intercept {a * 1e3:.2f} ms is below decode's fixed cost "
            f"{(s + q) * 1e3:.2f} ms: per-chunk overhead set to 0"
        )
        chunk = 0.0

    fitted = CostModel(
        model,
        _device(
            flops,
            bandwidth,
            cache_bytes,
            s,
            q,
            chunk,
            attention=(attention_flops, attention_bandwidth),
        ),
    )  # the residuals of the model as the simulator will use it
    residuals = [
        Residual(p.label, p.seconds, fitted.step_seconds(sl))
        for p, sl in zip(decode, slices, strict=True)
    ]
    residuals += [
        Residual(p.label, p.seconds, fitted.step_seconds([Slice(p.tokens, p.context)]))
        for p in prefill
    ]
    worst = max(residuals, key=lambda r: abs(r.relative))
    if abs(worst.relative) > MAX_RELATIVE_ERROR:
        raise FitError(
            f"the best fit misses {worst.label} by {worst.relative:+.0%} (measured "
            f"{worst.measured_s * 1e3:.2f} ms, fitted {worst.predicted_s * 1e3:.2f} ms; "
            + ", ".join(f"{r.label} {r.measured_s * 1e3:.1f} ms" for r in residuals)
            + "): the points are not one machine's steady costs (a busy machine?); "
            "not writing this spec"
        )
    return Fit(
        flops,
        bandwidth,
        s,
        q,
        chunk,
        tuple(residuals),
        tuple(notes),
        attention_flops,
        attention_bandwidth if attention_flops > 0 else 0.0,
    )


def _fit_prefill_rates(
    counts: CostModel, prefill: Sequence[PrefillPoint]
) -> tuple[float, float, float]:
    """Prefill's fixed cost, the matmuls' FLOP/s and, where the points show the attention running well below it
    (less than 1 / ``ATTENTION_APART`` of it), the attention's own FLOP/s (else 0: one rate)."""
    phases = [counts.phase_flops([Slice(p.tokens, p.context)]) for p in prefill]
    t = [p.seconds for p in prefill]
    a, inv_f = _weighted_lstsq([[1.0, m + at] for m, at in phases], t)
    if inv_f <= 0:
        raise FitError(
            "prefill time does not grow with prompt length ("
            + ", ".join(f"{p.tokens}: {p.seconds * 1e3:.1f} ms" for p in prefill)
            + "): the measurement is noise; calibrate on a quiet machine"
        )
    if len({(p.tokens, p.context) for p in prefill}) >= 4:
        try:
            a3, inv_m, inv_a = _weighted_lstsq([[1.0, m, at] for m, at in phases], t)
        except FitError:
            inv_m = inv_a = 0.0
        if inv_m > 0 and inv_a > ATTENTION_APART * inv_m:
            return a3, 1 / inv_m, 1 / inv_a
    return a, 1 / inv_f, 0.0


def _grid_search(error: Callable[[tuple[float, float]], float], split: bool) -> tuple[float, float]:
    """The (bandwidth, attention bandwidth) with the least ``error``: a log grid over
    ``_BANDWIDTH_GRID``, then two finer grids around the best (one axis unless ``split``)."""
    lo, hi = (math.log10(b) for b in _BANDWIDTH_GRID)
    steps = 96 if split else 600
    axis = [10 ** (lo + (hi - lo) * i / steps) for i in range(steps + 1)]
    grid = [(b, ba) for b in axis for ba in (axis if split else [b])]
    best = min(grid, key=error)
    ratio = 10 ** ((hi - lo) / steps)
    for _ in range(2):
        near = [best[0] * ratio ** (i / 10 - 1) for i in range(21)]
        near_a = [best[1] * ratio ** (i / 10 - 1) for i in range(21)] if split else [None]
        grid = [
            (b, b if ba is None else ba)
            for b in near
            for ba in near_a
            if _BANDWIDTH_GRID[0] <= b <= _BANDWIDTH_GRID[1]
        ]
        best = min(grid, key=error)
        ratio **= 0.1
    return best


def _device(
    flops: float,
    bandwidth: float,
    cache_bytes: float,
    step: float = 0.0,
    seq: float = 0.0,
    chunk: float = 0.0,
    attention: tuple[float, float] = (0.0, 0.0),
) -> DeviceSpec:
    attention_flops, attention_bandwidth = attention if attention[0] > 0 else (0.0, 0.0)
    return DeviceSpec(
        "fit",
        peak_flops=flops,
        mem_bandwidth=bandwidth,
        memory_bytes=1.0,
        link_bandwidth=1.0,
        step_overhead_s=step,
        seq_overhead_s=seq,
        chunk_overhead_s=chunk,
        cache_bytes=cache_bytes,
        attention_flops=attention_flops,
        attention_bandwidth=attention_bandwidth,
    )


def _weighted_lstsq(
    rows: Sequence[Sequence[float]], y: Sequence[float], scale: Sequence[float] | None = None
) -> list[float]:
    """Least squares of ``rows @ beta = y``, each row divided by its ``scale`` (default ``y``):
    relative errors. Normal equations, solved by Gaussian elimination (n <= 3 unknowns)."""
    scale = y if scale is None else scale
    n = len(rows[0])
    norm = [max(abs(row[j]) for row in rows) or 1.0 for j in range(n)]  # columns to ~1
    rows = [[row[j] / norm[j] for j in range(n)] for row in rows]
    ata = [[0.0] * n for _ in range(n)]
    aty = [0.0] * n
    for row, yi, si in zip(rows, y, scale, strict=True):
        w = 1.0 / (si * si)
        for j in range(n):
            aty[j] += w * row[j] * yi
            for k in range(n):
                ata[j][k] += w * row[j] * row[k]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(ata[r][col]))
        if abs(ata[pivot][col]) < 1e-300:
            raise FitError("the measured points cannot separate the fit's terms")
        ata[col], ata[pivot] = ata[pivot], ata[col]
        aty[col], aty[pivot] = aty[pivot], aty[col]
        for r in range(col + 1, n):
            f = ata[r][col] / ata[col][col]
            for k in range(col, n):
                ata[r][k] -= f * ata[col][k]
            aty[r] -= f * aty[col]
    beta = [0.0] * n
    for r in reversed(range(n)):
        beta[r] = (aty[r] - sum(ata[r][k] * beta[k] for k in range(r + 1, n))) / ata[r][r]
    return [b / nj for b, nj in zip(beta, norm, strict=True)]
