"""The simulator against the real mesh request by request, not only in percentiles (pure).

``kvmesh sim --validate --per-request`` pairs every real request with its simulated twin (same
index: same arrival, prompt and output lengths) and shows where they part:

- each request's TTFT and mean gap, real and simulated, and how many other requests the real
  mesh had in flight when it was sent (``in_flight``: sent before it and not yet finished);
- ``by_load``: the sum of real and of simulated TTFT over the requests sent to an idle mesh and
  over those sent to a busy one, so that a cost the simulator misses in every request (it shows
  when the mesh is idle) is told apart from one it misses only under concurrency (queueing,
  prefill sharing cores with decode steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.loadgen.serve_metrics import RequestRecord


@dataclass(frozen=True, slots=True)
class RequestPair:
    index: int
    send_s: float  # the real request's send time, from the run's start
    prompt_len: int
    output_len: int
    in_flight: int  # other real requests sent before it and not yet finished when it was sent
    real_ttft_s: float | None
    sim_ttft_s: float | None
    real_gap_s: float | None  # mean gap between its tokens
    sim_gap_s: float | None

    @property
    def ttft_ratio(self) -> float | None:
        if self.real_ttft_s is None or self.sim_ttft_s is None or self.real_ttft_s <= 0:
            return None
        return self.sim_ttft_s / self.real_ttft_s


def _mean_gap(record: RequestRecord) -> float | None:
    gaps = record.itl_s
    return sum(gaps) / len(gaps) if gaps else None


def in_flight_at(records: Sequence[RequestRecord], i: int) -> int:
    """Requests of ``records`` other than the ``i``-th sent before it and not finished when it
    was sent."""
    t = records[i].send_s
    return sum(1 for j, r in enumerate(records) if j != i and r.send_s <= t < r.end_s)


def pair(real: Sequence[RequestRecord], sim: Sequence[RequestRecord]) -> list[RequestPair]:
    """One row per request, real and simulated side by side (the same workload, in order)."""
    if len(real) != len(sim):
        raise ValueError(f"{len(real)} real records against {len(sim)} simulated")
    start = min((r.send_s for r in real), default=0.0)
    out = []
    for i, (r, s) in enumerate(zip(real, sim, strict=True)):
        if r.prompt_len != s.prompt_len:
            raise ValueError(
                f"request {i}: real prompt {r.prompt_len} tokens, simulated {s.prompt_len}: "
                "not the same workload"
            )
        out.append(
            RequestPair(
                index=i,
                send_s=r.send_s - start,
                prompt_len=r.prompt_len,
                output_len=r.output_len,
                in_flight=in_flight_at(real, i),
                real_ttft_s=r.ttft_s if r.is_ok else None,
                sim_ttft_s=s.ttft_s if s.is_ok else None,
                real_gap_s=_mean_gap(r) if r.is_ok else None,
                sim_gap_s=_mean_gap(s) if s.is_ok else None,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class LoadGroup:
    label: str
    count: int
    real_ttft_s: float  # sums over the group's requests
    sim_ttft_s: float

    @property
    def ratio(self) -> float | None:
        return self.sim_ttft_s / self.real_ttft_s if self.real_ttft_s > 0 else None


def by_load(pairs: Sequence[RequestPair]) -> list[LoadGroup]:
    """Summed TTFT, real and simulated, of the requests sent to an idle mesh and to a busy one."""
    groups = []
    for label, keep in (("idle", lambda p: p.in_flight == 0), ("busy", lambda p: p.in_flight > 0)):
        rows = [p for p in pairs if keep(p) and p.real_ttft_s is not None and p.sim_ttft_s]
        groups.append(
            LoadGroup(
                label,
                len(rows),
                sum(p.real_ttft_s for p in rows),  # type: ignore[misc]
                sum(p.sim_ttft_s for p in rows),  # type: ignore[misc]
            )
        )
    return groups


def format_pairs(mode: str, pairs: Sequence[RequestPair]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    lines = [
        f"{mode}, request by request:",
        "| # | sent s | prompt | output | in flight | TTFT real ms | TTFT sim ms | sim/real "
        "| gap real ms | gap sim ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        ratio = "-" if p.ttft_ratio is None else f"{p.ttft_ratio:.2f}x"
        lines.append(
            f"| {p.index} | {p.send_s:.2f} | {p.prompt_len} | {p.output_len} | {p.in_flight} | "
            f"{ms(p.real_ttft_s)} | {ms(p.sim_ttft_s)} | {ratio} | {ms(p.real_gap_s)} | "
            f"{ms(p.sim_gap_s)} |"
        )
    for g in by_load(pairs):
        ratio = "-" if g.ratio is None else f"{g.ratio:.2f}x"
        lines.append(
            f"sent to {'an' if g.label == 'idle' else 'a'} {g.label} mesh: {g.count} requests, "
            f"TTFT summed real "
            f"{g.real_ttft_s * 1e3:.0f} ms, sim {g.sim_ttft_s * 1e3:.0f} ms ({ratio})"
        )
    return "\n".join(lines)
