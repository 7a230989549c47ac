"""Where the engines' time went during a run, real or simulated, in the same few means (pure).

The real side comes from the mesh's own ``/metrics`` scraped before and after the run (every
service's, summed by name: ``prom_text.totals``):

- ``home_step_s``: a decode or colocated worker's engine step (``kvmesh_decode_step_seconds``:
  schedule, forward pass, sampling; not the loop around it);
- ``prefill_chunk_s``: a prefill worker's forward pass of one chunk
  (``kvmesh_prefill_chunk_compute_seconds``);
- ``prefill_queue_s``: a job's wait for a prefill worker (``kvmesh_prefill_queue_wait_seconds``).

The simulated side (``cluster.SimResult.timings``) counts the same things in the simulation:
wall time of each step (stretched by the cores it shared), a home step less its loop's share
(the loop and token overheads, the jitter), and a job's wait in the prefill queue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineTimings:
    home_steps: int
    home_step_s: float | None
    prefill_chunks: int
    prefill_chunk_s: float | None
    prefill_jobs: int
    prefill_queue_s: float | None

    @classmethod
    def between(cls, before: Mapping[str, float], after: Mapping[str, float]) -> EngineTimings:
        """Means over what the mesh did between two scrapes (cumulative counters)."""

        def mean(name: str) -> tuple[int, float | None]:
            count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
            total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
            return (int(count), total / count) if count > 0 else (0, None)

        steps, step = mean("kvmesh_decode_step_seconds")
        chunks, chunk = mean("kvmesh_prefill_chunk_compute_seconds")
        jobs, queue = mean("kvmesh_prefill_queue_wait_seconds")
        return cls(steps, step, chunks, chunk, jobs, queue)


def pooled(parts: list[EngineTimings]) -> EngineTimings:
    """Several runs' timings as one: counts added, means weighted by them."""

    def mean(count: str, value: str) -> tuple[int, float | None]:
        n = sum(getattr(p, count) for p in parts)
        total = sum(getattr(p, count) * (getattr(p, value) or 0.0) for p in parts)
        return n, (total / n if n else None)

    steps, step = mean("home_steps", "home_step_s")
    chunks, chunk = mean("prefill_chunks", "prefill_chunk_s")
    jobs, queue = mean("prefill_jobs", "prefill_queue_s")
    return EngineTimings(steps, step, chunks, chunk, jobs, queue)


def merge_scrapes(scrapes: list[Mapping[str, float]]) -> dict[str, float]:
    """Several services' samples as one: values of the same name summed (two decode workers)."""
    out: dict[str, float] = {}
    for scrape in scrapes:
        for name, value in scrape.items():
            out[name] = out.get(name, 0.0) + value
    return out


def format_timings(mode: str, real: EngineTimings | None, sim: EngineTimings) -> str:
    def cell(t: EngineTimings | None, count: str, mean: str) -> str:
        if t is None or getattr(t, mean) is None:
            return "-"
        return f"{getattr(t, mean) * 1e3:.1f} ms x {getattr(t, count)}"

    lines = [
        f"{mode}, engines (mean x count):",
        "| | decode/colocated step | prefill chunk | prefill queue wait |",
        "|---|---|---|---|",
    ]
    for name, t in (("real", real), ("sim", sim)):
        lines.append(
            f"| {name} | {cell(t, 'home_steps', 'home_step_s')} | "
            f"{cell(t, 'prefill_chunks', 'prefill_chunk_s')} | "
            f"{cell(t, 'prefill_jobs', 'prefill_queue_s')} |"
        )
    return "\n".join(lines)
