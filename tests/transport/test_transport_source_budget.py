"""Per-source budgets of a receiver and the writer's backoff (issue 40): pure, clock passed in."""

from __future__ import annotations

import random

import pytest
from kvmesh.shared.transport.backoff import Backoff
from kvmesh.shared.transport.source_budget import (
    BudgetVerdict,
    SourceBudget,
    SourceLimits,
    TokenBucket,
    source_of,
)


def test_token_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    bucket = TokenBucket.full(rate=10.0, burst=3, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(0.05)  # half a token
    assert bucket.take(0.1)
    assert not bucket.take(0.1)
    bucket.refill(100.0)
    assert bucket.tokens == 3  # never above its burst


def test_token_bucket_ignores_a_clock_that_goes_back() -> None:
    bucket = TokenBucket.full(rate=1.0, burst=1, now=10.0)
    assert bucket.take(10.0)
    assert not bucket.take(5.0)
    assert not bucket.take(10.5)
    assert bucket.take(11.0)


def test_accepts_over_a_sources_rate_are_refused_while_other_sources_are_admitted() -> None:
    budget = SourceBudget(SourceLimits(accepts_per_s=10.0, accept_burst=5))
    flood = [budget.admit("127.0.0.2", now=0.0) for _ in range(8)]
    assert flood == [BudgetVerdict.ADMIT] * 5 + [BudgetVerdict.RATE_LIMITED] * 3
    assert budget.admit("127.0.0.1", now=0.0) is BudgetVerdict.ADMIT
    assert budget.admit("127.0.0.2", now=0.1) is BudgetVerdict.ADMIT  # one token back after 0.1 s


def test_accepts_per_source_are_bounded_by_the_rate_over_a_long_flood() -> None:
    budget = SourceBudget(SourceLimits(accepts_per_s=50.0, accept_burst=100))
    admitted = sum(
        budget.admit("10.0.0.9", now=i / 20_000) is BudgetVerdict.ADMIT for i in range(200_000)
    )  # 20k connections a second for 10 s
    assert 100 + 50 * 10 - 1 <= admitted <= 100 + 50 * 10


def test_a_source_that_spends_its_refusals_is_blocked_for_block_s() -> None:
    budget = SourceBudget(SourceLimits(max_refusals=4, block_s=10.0))
    assert [budget.refused("127.0.0.3", now=0.0) for _ in range(5)] == [False] * 4 + [True]
    assert budget.admit("127.0.0.3", now=1.0) is BudgetVerdict.BLOCKED
    assert budget.admit("127.0.0.1", now=1.0) is BudgetVerdict.ADMIT  # others are not
    assert budget.is_blocked("127.0.0.3", now=9.9)
    assert budget.admit("127.0.0.3", now=10.1) is BudgetVerdict.ADMIT


def test_refusal_guessing_per_source_is_bounded_by_the_budget_when_each_guess_is_a_fresh_lane() -> (
    None
):
    """A prober that opens a fresh endpoint per guess (16.7k/s before): each guess is a refusal
    of its source, and once blocked its connections are reset at accept, so no more guesses
    reach a window."""
    limits = SourceLimits(max_refusals=64, block_s=30.0, accept_burst=1 << 20, accepts_per_s=1e6)
    budget = SourceBudget(limits)
    guesses = 0
    for i in range(16_700 * 60):  # a minute at the old rate
        now = i / 16_700
        if budget.admit("127.0.0.4", now) is not BudgetVerdict.ADMIT:
            continue
        guesses += 1
        budget.refused("127.0.0.4", now)
    # the burst, then per blocked period at most what refilled while it was blocked
    assert guesses <= 64 * (1 + 60 / 30) + 2


def test_sources_remembered_are_bounded_and_settled_ones_go_first() -> None:
    budget = SourceBudget(SourceLimits(max_sources=8, max_refusals=1, block_s=100.0))
    budget.refused("blocked", now=0.0)
    assert budget.refused("blocked", now=0.0)
    for i in range(50):
        budget.admit(f"10.0.0.{i}", now=float(i))  # each settled again a second later
    assert len(budget) <= 8
    assert budget.is_blocked("blocked", now=50.0)  # the one that matters is kept


def test_source_of_groups_an_ipv6_hosts_addresses_by_their_64() -> None:
    assert source_of(("127.0.0.7", 5000)) == "127.0.0.7"
    assert source_of(("2001:db8::1", 1, 0, 0)) == source_of(("2001:db8::ffff:1", 2, 0, 0))
    assert source_of(("2001:db8:0:1::1", 1, 0, 0)) != source_of(("2001:db8::1", 1, 0, 0))
    assert source_of(("::ffff:10.1.2.3", 1, 0, 0)) == "10.1.2.3"
    assert source_of("") == "local"


def test_backoff_waits_grow_with_jitter_and_stop_at_the_total_time() -> None:
    backoff = Backoff(first_s=0.1, max_s=0.8, total_s=5.0)
    rng = random.Random(7)
    waits = [backoff.delay(n, 0.0, rng) for n in range(1, 7)]
    caps = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    for wait, cap in zip(waits, caps, strict=True):
        assert wait is not None and cap / 2 <= wait <= cap
    assert len({round(w, 6) for w in waits if w is not None}) == len(waits)  # jittered
    assert backoff.delay(3, 4.95, rng) == pytest.approx(0.05)  # cut to end at total_s
    assert backoff.delay(3, 5.0, rng) is None


def test_backoff_tries_fit_in_the_total_time_whatever_the_jitter() -> None:
    backoff = Backoff(first_s=0.02, max_s=1.0, total_s=3.0)
    for seed in range(50):
        rng, elapsed, attempt = random.Random(seed), 0.0, 1
        while (wait := backoff.delay(attempt, elapsed, rng)) is not None:
            elapsed += wait + 0.01  # each try costs a little
            attempt += 1
        assert 3.0 <= elapsed <= 3.0 + 0.01 and attempt > 5


def test_backoff_rejects_a_first_wait_longer_than_its_longest() -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s=2.0, max_s=1.0)
