"""What the router knows of the prefill queue from its own publishes (pure).

"No stream answered" means the queue is missing (a hand-started mesh whose admin never made it)
or, on a cluster, leaderless for a few seconds. A router that has stored a job since the queue
was last found missing keeps retrying until the request's first-token deadline (a leader is
elected in seconds); one that has not gives up after ``grace_s``: each request that needs a
prefill is then a 503 that names what is missing, and ``/health`` says so, instead of every
such request waiting out its deadline (issue 43: 120 s seen).
"""

from __future__ import annotations

from dataclasses import dataclass

GRACE_S = 2.0  # how long a router that never stored a job retries "no stream answered"


@dataclass(slots=True)
class PrefillQueueHealth:
    grace_s: float = GRACE_S
    has_stored: bool = False  # a job was stored since the router started or found it missing
    missing: str = ""  # why the last publish failed, while none has been stored since

    def retry_for_s(self, left_s: float) -> float:
        """How long a publish may retry, with ``left_s`` left to the request's deadline."""
        return left_s if self.has_stored else min(left_s, self.grace_s)

    def on_stored(self) -> None:
        self.has_stored, self.missing = True, ""

    def on_missing(self, error: str) -> None:
        """A publish gave up: no queue took the job. The next ones give up after the grace."""
        self.has_stored, self.missing = False, error
