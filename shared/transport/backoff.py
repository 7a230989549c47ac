"""How long a writer waits before it tries a refused connection again (pure, clock passed in).

A receiver under a connection flood resets some handshakes (over a source's budget, pushed out,
or its backlog full), and a restarting one refuses connections for a moment: a writer tries
again after a jittered, exponentially growing wait, until ``total_s`` has passed since its first
try; only then is the peer unreachable (issue 40: a restarted prefill's reset handshakes were
reported at once as "cannot reach tcp peer").
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# A reset, a refusal, an abort: the receiver is there but said no for now. A timeout is not
# here: the writer has already waited its connect timeout.
RETRIABLE: tuple[type[OSError], ...] = (
    ConnectionResetError,
    ConnectionRefusedError,
    ConnectionAbortedError,
    BrokenPipeError,
)


@dataclass(frozen=True, slots=True)
class Backoff:
    first_s: float = 0.02  # the first wait's upper bound
    max_s: float = 1.0  # no wait is longer
    total_s: float = 5.0  # no try starts later than this after the first

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {self.first_s}, {self.max_s}")
        if self.total_s < 0:
            raise ValueError(f"total_s must not be negative, got {self.total_s}")

    def delay(self, attempt: int, elapsed_s: float, rng: random.Random) -> float | None:
        """The wait before try ``attempt + 1`` (``attempt`` tries failed, the first began
        ``elapsed_s`` ago), or None: give up. Equal jitter: uniform in [cap/2, cap], where cap
        doubles each try from ``first_s`` up to ``max_s``, so writers that were reset together
        do not come back together; the last wait is cut to end at ``total_s``."""
        assert attempt >= 1, "a delay comes after a failed try"
        left = self.total_s - elapsed_s
        if left <= 0:
            return None
        cap = min(self.max_s, self.first_s * 2.0 ** min(attempt - 1, 62))
        return min(left, cap * (0.5 + 0.5 * rng.random()))


__all__ = ["RETRIABLE", "Backoff"]
