"""A store answers a solicit at once, at most once per interval (shared/bus/store_solicit.py)."""

from __future__ import annotations

from kvmesh.shared.bus.store_solicit import MIN_INTERVAL_S, SolicitLimiter


def test_a_store_answers_the_first_solicit_and_at_most_one_per_interval():
    now = [100.0]
    limiter = SolicitLimiter(0.1, clock=lambda: now[0])
    assert limiter.answer()  # the first: at once
    now[0] += 0.05
    assert not limiter.answer()  # within the interval of the last answered: not again
    now[0] += 0.04
    assert not limiter.answer()
    now[0] += 0.02  # 0.11 s after the last answered one
    assert limiter.answer()
    assert not limiter.answer()


def test_a_flood_of_solicits_costs_one_advert_per_interval():
    now = [0.0]
    limiter = SolicitLimiter(clock=lambda: now[0])
    answered = 0
    for _ in range(1000):  # 1,000 solicits over 1 s
        answered += limiter.answer()
        now[0] += 0.001
    assert answered == round(1.0 / MIN_INTERVAL_S)
