"""The SLA a plan is judged by: p99 TTFT and p99 inter-token latency, checked per request.

``kvmesh bench serve``'s goodput (``serve_metrics.Slo``, vLLM's definition) checks a request's
TPOT, its *mean* gap; one long freeze inside an otherwise fast stream passes it. An SLA stated as
"p99 ITL < 30 ms" is about the tail of the gaps, so here a request is good when it completed,
its TTFT is within ``ttft_ms`` and the 99th percentile of its own token gaps is within
``itl_ms`` (a 512-token stream may have five slow gaps, not fifty). Both goodputs are reported;
this one is the planner's objective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord, Slo, percentile


@dataclass(frozen=True, slots=True)
class Sla:
    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            raise ValueError(f"SLA limits must be > 0 ms, got {self}")

    @property
    def slo(self) -> Slo:
        """The same limits as ``bench serve``'s SLO (ITL checked against TPOT)."""
        return Slo(ttft_ms=self.ttft_ms, tpot_ms=self.itl_ms)

    def is_met(self, record: RequestRecord) -> bool:
        ttft = record.ttft_s
        if not record.is_ok or ttft is None or ttft * 1e3 > self.ttft_ms:
            return False
        gaps = record.itl_s
        return not gaps or percentile(gaps, 99) * 1e3 <= self.itl_ms

    def goodput(self, records: Sequence[RequestRecord], duration_s: float) -> float:
        """Requests per second that met the SLA."""
        assert duration_s > 0
        return sum(self.is_met(r) for r in records) / duration_s
