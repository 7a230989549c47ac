"""Where each request's time to first token went, as the router pieces it together.

The router's histograms say how long placements, prefill queues and prefill compute took on
average; they cannot say which of them made one slow request slow, nor give a stage's p99 more
precisely than a bucket. So every finished request also leaves a ``RequestTiming`` in a bounded
log (``TimingLog``, the newest ``capacity``), which ``GET /v1/kvmesh/timings`` returns
(behind the API key, like every /v1 route: the ids are the clients'; a tenant's key sees only
its own requests, the admin key every tenant's: services/router/tenants.py). ``kvmesh bench serve``
reads it after a run and joins it to its own records by response id.

The stages add up to the router's TTFT (arrival to first token):

- ``admission_s``: arrival until the placement attempt that succeeded began (body parsing,
  tokenizing, and the waits while the mesh had no room);
- ``place_s``: that attempt (the kv-registry's choice and the decode worker's reservation);
- ``prefill_queue_s``: a remote prefill's job waiting for a prefill worker; a local one's wait
  in the decode worker for its first chunk to be computed;
- ``prefill_s``: a remote prefill's compute; a local one's first chunk to first token (the
  steps it shared with other sequences included);
- ``transfer_s``: KV transfer time the prefill's compute did not hide;
- ``admit_s``: a remote prefill heard done until the decode worker admitted it (the step in
  flight);
- ``relay_s``: the rest: publishing the job, NATS hops, the first token's way back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's time to first token by stage (seconds)."""

    request_id: str  # the id the client saw
    local_prefill: bool
    num_prompt_tokens: int
    ttft_s: float
    admission_s: float
    place_s: float
    prefill_queue_s: float
    prefill_s: float
    transfer_s: float
    admit_s: float
    relay_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


STAGES = (
    "admission_s",
    "place_s",
    "prefill_queue_s",
    "prefill_s",
    "transfer_s",
    "admit_s",
    "relay_s",
)


@dataclass(slots=True)
class TimingStamps:
    """What one request's dispatch learns on its way to the first token (monotonic times and
    reported durations); ``timing()`` turns them into a ``RequestTiming``."""

    arrived_at: float
    place_started_at: float | None = None  # of the latest placement attempt
    placed_at: float | None = None
    local_prefill: bool = False
    remote_queue_s: float = 0.0  # from the prefill worker's report
    remote_compute_s: float = 0.0
    remote_transfer_s: float = 0.0
    decode_wait_s: float = 0.0  # from the decode worker's first token event
    decode_prefill_s: float = 0.0

    def timing(
        self, request_id: str, first_token_at: float, num_prompt_tokens: int
    ) -> RequestTiming | None:
        """The stages up to ``first_token_at``; None when the request was never placed."""
        if self.placed_at is None or self.place_started_at is None:
            return None
        ttft = max(0.0, first_token_at - self.arrived_at)
        admission = max(0.0, self.place_started_at - self.arrived_at)
        place = max(0.0, self.placed_at - self.place_started_at)
        if self.local_prefill:
            queue, prefill, transfer, admit = self.decode_wait_s, self.decode_prefill_s, 0.0, 0.0
        else:
            queue, prefill = self.remote_queue_s, self.remote_compute_s
            transfer, admit = self.remote_transfer_s, self.decode_wait_s
        relay = ttft - (admission + place + queue + prefill + transfer + admit)
        if relay < 0:
            # A local prefill's wait starts when the decode worker accepts it, during the
            # placement: the overlap is the placement's, so the wait gives it back first.
            queue, relay = max(0.0, queue + relay), min(0.0, queue + relay)
            prefill = max(0.0, prefill + relay)
        return RequestTiming(
            request_id=request_id,
            local_prefill=self.local_prefill,
            num_prompt_tokens=num_prompt_tokens,
            ttft_s=ttft,
            admission_s=admission,
            place_s=place,
            prefill_queue_s=queue,
            prefill_s=prefill,
            transfer_s=transfer,
            admit_s=admit,
            relay_s=max(0.0, ttft - (admission + place + queue + prefill + transfer + admit)),
        )


class TimingLog:
    """The timings of the latest ``capacity`` finished requests, oldest first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"a timing log holds at least one request, got {capacity}")
        self._timings: deque[tuple[str, RequestTiming]] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._timings)

    def add(self, timing: RequestTiming, tenant: str = "") -> None:
        self._timings.append((tenant, timing))

    def to_json(self, tenant: str | None = None) -> dict[str, Any]:
        """The log; with ``tenant``, only that tenant's requests (another tenant's ids, prompt
        lengths and cache hits are none of its business)."""
        timings = [t for who, t in self._timings if tenant is None or who == tenant]
        return {"stages": list(STAGES), "requests": [t.to_json() for t in timings]}
