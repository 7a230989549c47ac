"""Statistics the sampling tests judge by."""

from __future__ import annotations

import math


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularised upper gamma Q(df/2, x/2) in closed form
    (even df: a Poisson sum; odd df: erfc plus a half-integer series)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    total = math.erfc(math.sqrt(h))
    term = math.exp(-h) * math.sqrt(h) / math.gamma(1.5)
    for i in range((df - 1) // 2):
        total += term
        term *= h / (i + 1.5)
    return total
