"""Prompt-length distributions of ``kvmesh bench serve``: moments, clipping, context, seeds."""

from __future__ import annotations

import random
import statistics

import pytest
from kvmesh.loadgen.length_dist import LengthDistribution
from kvmesh.loadgen.workload import WorkloadError, sample_lengths

NUM = 20_000


def draws(dist: LengthDistribution, seed: int = 1, num: int = NUM) -> list[int]:
    rng = random.Random(seed)
    return [dist.sample(rng) for _ in range(num)]


def test_normal_lengths_have_the_asked_mean_and_sd_when_nothing_is_clipped():
    values = draws(LengthDistribution("normal", 1, 100_000, mean=1500, sd=300))
    assert statistics.fmean(values) == pytest.approx(1500, rel=0.01)
    assert statistics.pstdev(values) == pytest.approx(300, rel=0.03)


def test_lognormal_lengths_have_the_asked_mean_and_sd_of_the_lengths():
    values = draws(LengthDistribution("lognormal", 1, 1_000_000, mean=1500, sd=700))
    assert statistics.fmean(values) == pytest.approx(1500, rel=0.02)
    assert statistics.pstdev(values) == pytest.approx(700, rel=0.06)
    assert statistics.median(values) < statistics.fmean(values)  # skewed right


def test_draws_are_clipped_to_the_bounds_and_pile_up_there():
    values = draws(LengthDistribution("normal", 800, 2000, mean=1500, sd=700))
    assert min(values) == 800 and max(values) == 2000
    at_low = values.count(800) / NUM
    assert at_low == pytest.approx(statistics.NormalDist(1500, 700).cdf(800), abs=0.02)


def test_the_same_seed_draws_the_same_lengths():
    dist = LengthDistribution("lognormal", 16, 4800, mean=1500, sd=700)
    assert draws(dist, seed=7, num=50) == draws(dist, seed=7, num=50)
    assert draws(dist, seed=7, num=50) != draws(dist, seed=8, num=50)


def test_uniform_is_the_length_spec_of_today():
    dist = LengthDistribution.parse("uniform", 100, "10:30")
    assert (dist.low, dist.high) == (10, 30)
    assert set(draws(dist, num=2000)) == set(range(10, 31))
    assert LengthDistribution.parse("uniform", 100, "0.25").low == 75


def test_parse_reads_mean_sd_and_clip_bounds():
    dist = LengthDistribution.parse("normal", 1500, "128:4800", sd=700)
    assert dist == LengthDistribution("normal", 128, 4800, mean=1500.0, sd=700.0)
    assert LengthDistribution.parse("lognormal", 100, None, sd=10).high == 160


@pytest.mark.parametrize(
    ("kind", "spread", "sd", "message"),
    [
        ("normal", "128:4800", None, "needs --input-len-sd"),
        ("normal", "0.3", 10.0, "clipped to MIN:MAX"),
        ("normal", "50:10", 10.0, "1 <= min <= max"),
        ("normal", "1:10", -1.0, "sd >= 0"),
        ("uniform", None, 5.0, "applies to normal and lognormal"),
        ("zipf", "1:10", 1.0, "must be one of"),
    ],
)
def test_bad_distributions_are_refused_with_the_flag_to_fix(kind, spread, sd, message):
    with pytest.raises(WorkloadError, match=message):
        LengthDistribution.parse(kind, 100, spread, sd)


def test_fit_context_cuts_the_high_bound_to_leave_room_for_the_output():
    dist = LengthDistribution("normal", 128, 4800, mean=1500, sd=700)
    fitted = dist.fit_context(max_model_len=2048, output_len=96)
    assert fitted.high == 1952
    assert max(draws(fitted, num=5000)) == 1952
    assert dist.fit_context(8192, 96) == dist
    with pytest.raises(WorkloadError, match="do not fit the model's context of 200"):
        dist.fit_context(max_model_len=200, output_len=96)


def test_sample_lengths_takes_a_distribution_for_the_inputs():
    dist = LengthDistribution("normal", 100, 200, mean=150, sd=30)
    out = LengthDistribution("uniform", 96, 96)
    pairs = sample_lengths(500, dist, out, random.Random(0))
    assert all(100 <= n <= 200 and m == 96 for n, m in pairs)
