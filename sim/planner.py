"""The planner: the prefill:decode split (and prefill chunk size) with the highest SLA goodput.

DistServe-style search by simulation: every split of the GPU budget into P prefill and D decode
workers (each ``tp`` GPUs) is simulated on the workload at the default chunk size; the chunk
sizes are then tried on the best split (chunking moves little once prefill has a GPU of its own,
so a search over splits x chunks would spend most of its time on splits already lost). The winner
has the highest goodput under the SLA (``sla.Sla``: TTFT and each request's p99 gap), ties going
to the lower p99 TTFT. ``explain`` says what bounds the neighbours: one prefill worker fewer and
prompts queue (TTFT); one decode worker fewer and batches grow (ITL) or KV room runs out
(requests wait for placement, which shows as TTFT).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvmesh.sim.cluster import SimResult, simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.sla import Sla
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import SimRequest

DEFAULT_CHUNKS = (1024, 2048, 4096, 8192)


@dataclass(frozen=True, slots=True)
class SimCandidate:
    result: SimResult
    sla_goodput: float

    @property
    def topology(self) -> Topology:
        return self.result.topology


@dataclass(frozen=True, slots=True)
class SimPlan:
    sla: Sla
    num_gpus: int
    splits: tuple[SimCandidate, ...]  # every P:D split at the default chunk, by P
    chunks: tuple[SimCandidate, ...]  # the best split at every chunk size tried
    best: SimCandidate


def evaluate(
    topology: Topology, cost: CostModel, requests: Sequence[SimRequest], sla: Sla
) -> SimCandidate:
    result = simulate(topology, cost, requests, sla.slo)
    return SimCandidate(result, sla.goodput(result.records, result.summary.duration_s))


def _rank(c: SimCandidate) -> tuple[float, float]:
    ttft = c.result.summary.ttft
    return (c.sla_goodput, -(ttft.p99_ms if ttft else float("inf")))


def plan(
    cost: CostModel,
    requests: Sequence[SimRequest],
    sla: Sla,
    num_gpus: int,
    *,
    base: Topology | None = None,
    chunk_sizes: Sequence[int] = DEFAULT_CHUNKS,
) -> SimPlan:
    """Search the splits of ``num_gpus`` GPUs; ``base`` gives the other knobs (chunk, tp, ...)."""
    base = base or Topology("disagg", num_decode=1, num_prefill=1)
    num_workers = num_gpus // base.tp
    if num_workers < 2:
        raise ValueError(
            f"{num_gpus} GPUs hold {num_workers} worker(s) of tp {base.tp}: a split needs two"
        )
    splits = tuple(
        evaluate(
            replace(base, mode="disagg", num_prefill=p, num_decode=num_workers - p),
            cost,
            requests,
            sla,
        )
        for p in range(1, num_workers)
    )
    best_split = max(splits, key=_rank)
    chunks = tuple(
        best_split
        if size == best_split.topology.chunk_tokens
        else evaluate(replace(best_split.topology, chunk_tokens=size), cost, requests, sla)
        for size in sorted(set(chunk_sizes) | {base.chunk_tokens or DEFAULT_CHUNKS[1]})
    )
    return SimPlan(sla, num_gpus, splits, chunks, max(chunks, key=_rank))


def _bound(c: SimCandidate, sla: Sla) -> str:
    s = c.result.summary
    ttft = s.ttft.p99_ms if s.ttft else float("inf")
    itl = s.itl.p99_ms if s.itl else float("inf")
    misses = []
    if ttft > sla.ttft_ms:
        misses.append(f"p99 TTFT {ttft / 1e3:.2f} s > {sla.ttft_ms / 1e3:g} s")
    if itl > sla.itl_ms:
        misses.append(f"p99 ITL {itl:.1f} ms > {sla.itl_ms:g} ms")
    return "; ".join(misses) or "meets both p99 targets"


def explain(p: SimPlan) -> list[str]:
    """Why the best candidate won, in a few lines a person can check against the table."""
    best = p.best
    t = best.topology
    lines = [
        f"planner: {t.num_prefill} prefill + {t.num_decode} decode workers"
        f"{f' of tp {t.tp}' if t.tp > 1 else ''} ({p.num_gpus} GPUs), prefill chunk "
        f"{t.chunk_tokens} tokens: SLA goodput {best.sla_goodput:.2f} req/s "
        f"({_bound(best, p.sla)}); prefill busy {best.result.prefill_busy:.0%}, decode batch "
        f"{best.result.mean_decode_batch:.1f} on average",
    ]
    by_prefill = {c.topology.num_prefill: c for c in p.splits}
    for label, n in (
        ("one prefill worker fewer", t.num_prefill - 1),
        ("one more", t.num_prefill + 1),
    ):
        other = by_prefill.get(n)
        if other is not None:
            lines.append(
                f"  {label} ({other.topology.num_prefill}P:{other.topology.num_decode}D): "
                f"{other.sla_goodput:.2f} req/s, {_bound(other, p.sla)}"
            )
    if len(p.chunks) > 1:
        chunk_text = ", ".join(f"{c.topology.chunk_tokens}: {c.sla_goodput:.2f}" for c in p.chunks)
        lines.append(f"  chunk sizes on this split (SLA goodput, req/s): {chunk_text}")
    return lines
