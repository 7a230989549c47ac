"""What a real mesh's probe shows (pure; ``probe.py`` serves it, ``overheads.py`` fits the
mesh's overheads to it): three figures of each mode's probe, taken the same way from the real
records and the simulated ones (``ProbeFigures``), and the jitter of its gaps (``jitter_of``: a ``mesh_terms.Jitter``).

- ``ttft_s``: the median TTFT of the isolated requests;
- ``gap_1_s``: the isolated requests' steady gap, the mean gap over the second half of each
  one's tokens, pooled over the requests (the decode loop's period at batch 1);
- ``gap_batch_s``: the same over the batch's requests (the period at batch ``probe.BATCH``).

Mean gaps, not single ones: a client on a busy machine reads several SSE events at once, which
shows as gaps of 0 beside a long one, but leaves their mean alone. Pooled, so that the stalls
below, counted over the same gaps, are part of the same mean.

The jitter (``jitter_of``) is measured before the fit, from each mode's isolated requests'
gaps (the second half of each stream): how far their 90th and 99th percentiles and their
largest exceed their own request's median, and how each request's steady gap spreads around
their mean (the pace). The simulator draws every loop step's jitter from its mode's
distribution (a seeded draw) and gives each sequence a pace, which gives its gaps the spread
and tail a real mesh's have; the loop and token terms are then fitted with both in, so the
mean gap still matches. Each mode's
own: measured on both modes' gaps together, the jitter had a p99 excess of 12.4-12.7 ms in two
calibrations, where the disagg mesh's real ITL p99 was 7-9 ms; with that in, the disagg loop
terms came out 0-0.1 ms and the validation's disagg ITL 0.56-0.75x at p50 and 1.34-2.17x at
p99 (docs/sim.md). A colocated worker's threads take every core beside the router and NATS, so
its gaps can stall longer than a disagg decode worker's.

With several probe runs (``--probe-runs N``) each figure is the median of the runs' own
(``ProbeFigures.median``: one disturbed run moves none of them). The jitter is measured on every
run's gaps together: a validation pools its repeats' gaps the same way, so a run slower
throughout than the others widens the spread of paces it measures. (The median of
each run's own percentiles, used before, was short of the pooled tail: on three validations'
real gaps by 0.02-1.0 ms at p99, 0.2-0.4 ms in most.)
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.cost import pace_quantiles, quantile_mean
from kvmesh.sim.mesh_terms import PACE_QUANTILES, Jitter
from kvmesh.sim.probe import BATCH


class OverheadFitError(ValueError):
    """Probe records the fit cannot use (no colocated probe, failed or too short requests)."""


def _require_served(records: Sequence[RequestRecord]) -> None:
    """Refuse probe records with a failed request (or one without a first token)."""
    bad = [r for r in records if r.error is not None or r.ttft_s is None]
    if bad:
        raise OverheadFitError(f"probe request {bad[0].index} failed: {bad[0].error}")


def median_ttft_s(records: Sequence[RequestRecord]) -> float:
    """The median TTFT of served probe records (``_require_served``)."""
    _require_served(records)
    return statistics.median(r.ttft_s for r in records)  # type: ignore[misc]


def steady_span(record: RequestRecord) -> tuple[float, int]:
    """Time and number of gaps of the second half of a request's stream."""
    times = record.chunk_times
    if len(times) < 4:
        raise OverheadFitError(
            f"probe request {record.index} streamed {len(times)} tokens; the fit needs at least 4"
        )
    k = len(times) // 2
    return times[-1] - times[k], len(times) - 1 - k


def steady_gap_s(records: Sequence[RequestRecord]) -> float:
    """Mean gap between the tokens of the second half of each stream, pooled over ``records``."""
    spans = [steady_span(r) for r in records]
    return sum(t for t, _ in spans) / sum(n for _, n in spans)


@dataclass(frozen=True, slots=True)
class ProbeFigures:
    """One mode's probe in three numbers (seconds)."""

    ttft_s: float
    gap_1_s: float
    gap_batch_s: float

    @classmethod
    def of(cls, isolated: Sequence[RequestRecord], batch: Sequence[RequestRecord]) -> ProbeFigures:
        _require_served([*isolated, *batch])
        if not isolated or not batch:
            raise OverheadFitError("the probe needs isolated requests and a batch")
        return cls(
            statistics.median(r.ttft_s for r in isolated),  # type: ignore[misc]
            steady_gap_s(isolated),
            steady_gap_s(batch),
        )

    @classmethod
    def median(cls, runs: Sequence[ProbeFigures]) -> ProbeFigures:
        """Several probe runs' figures of one mode as one: each figure the median over the runs."""
        if not runs:
            raise OverheadFitError("no probe runs")
        return cls(
            statistics.median(f.ttft_s for f in runs),
            statistics.median(f.gap_1_s for f in runs),
            statistics.median(f.gap_batch_s for f in runs),
        )

    def items(self) -> tuple[tuple[str, float], ...]:
        return (
            ("TTFT", self.ttft_s),
            ("gap at batch 1", self.gap_1_s),
            (f"gap at batch {BATCH}", self.gap_batch_s),
        )


def jitter_of(records: Sequence[RequestRecord]) -> Jitter:
    """The jitter (``mesh_terms.Jitter``) of the gaps of the second half of each (batch-1)
    stream (a stream with fewer than 2 such gaps is left out)."""
    halves = [h for r in records if len(h := r.itl_s[len(r.itl_s) // 2 :]) >= 2]
    if not halves:
        return Jitter()
    excess = [g - statistics.median(h) for h in halves for g in h]
    cuts = statistics.quantiles(excess, n=100, method="inclusive")
    return Jitter(
        max(0.0, cuts[89]),
        max(0.0, cuts[98]),
        max(0.0, max(excess)),
        pace_knots([sum(h) / len(h) for h in halves]),
    )


def pace_knots(steady_gaps: Sequence[float]) -> tuple[float, ...]:
    """The paces at ``PACE_QUANTILES`` of requests whose steady gaps are ``steady_gaps``: their
    quantiles, over the mean of the piecewise-linear distribution through them (mean 1); all 1
    for fewer than two requests."""
    if len(steady_gaps) < 2 or min(steady_gaps) <= 0:
        return (1.0,) * len(PACE_QUANTILES)
    deciles = statistics.quantiles(steady_gaps, n=10, method="inclusive")
    knots = (min(steady_gaps), deciles[0], deciles[4], deciles[8], max(steady_gaps))
    mean = quantile_mean(pace_quantiles(knots))
    return tuple(x / mean for x in knots)


def mode_jitters(jitters: Mapping[str, Jitter]) -> tuple[Jitter, Jitter]:
    """The (colocated, disagg decode) jitters of a probe's per-mode ``jitters``: a mode the probe
    did not serve takes the other's; neither, none."""
    colocated = jitters.get("colocated", jitters.get("disagg", Jitter()))
    return colocated, jitters.get("disagg", colocated)
