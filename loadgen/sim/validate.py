"""The simulator against the real mesh: one workload, simulated and served, colocated and disagg.

The real side is ``kvmesh bench serve --compare``'s machinery: ``bench_serve.build_workload``
makes the prompts (exact token lengths, from the seed), ``arrivals.arrival_times`` the send
times, ``bench_mesh.local_mesh`` a fresh mesh of each mode on this machine's cores (kvmesh up's
defaults, one prefill worker) and ``sse_client.run_requests`` the streamed requests. The
simulated side runs the same lengths and arrival times on a topology that mirrors that mesh:
one worker of each role on one shared device (the calibrated CPU spec), the mesh's step budgets
(512 tokens for colocated and prefill chunks), its 256 MiB KV pool per worker, and the threads
and niceness ``kvmesh up`` gives each role (``up.split_cores``): on 2 cores colocated runs 2
threads; disagg runs decode on 1 thread and prefill on 2 at equal priority, or, with
``--prefill-nice N``, decode on 2 threads and prefill on 2 at nice N.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.serve_metrics import RequestRecord, Summary, summarize
from kvmesh.loadgen.sim.cluster import simulate
from kvmesh.loadgen.sim.cost import CostModel
from kvmesh.loadgen.sim.engine_timings import EngineTimings, merge_scrapes
from kvmesh.loadgen.sim.topology import Topology
from kvmesh.loadgen.sim.workload import SimRequest

MESH_CHUNK_TOKENS = 512  # decode/colocated --max-num-batched-tokens and prefill --chunk-tokens
MESH_MAX_NUM_SEQS = 64
MESH_KV_CACHE_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class Comparison:
    mode: str
    real: Summary
    sim: Summary
    real_records: tuple[RequestRecord, ...] = ()
    sim_records: tuple[RequestRecord, ...] = ()
    real_timings: EngineTimings | None = None  # None: the mesh's /metrics could not be read
    sim_timings: EngineTimings | None = None

    def ratios(self) -> dict[str, float | None]:
        """sim / real of p50 and p99 TTFT and ITL."""
        out: dict[str, float | None] = {}
        for metric in ("ttft", "itl"):
            real, sim = getattr(self.real, metric), getattr(self.sim, metric)
            for p in ("p50_ms", "p99_ms"):
                key = f"{metric.upper()} {p[:3]}"
                ok = real is not None and sim is not None and getattr(real, p) > 0
                out[key] = getattr(sim, p) / getattr(real, p) if ok else None
        return out


def mesh_topology(mode: str, cost: CostModel, prefill_nice: int = 0) -> Topology:
    """The simulated twin of ``local_mesh(mode, prefill_nice=...)`` on the spec's cores."""
    from kvmesh.commands.up import UpConfig, split_cores

    threads = split_cores(UpConfig(mode=mode, prefill_nice=prefill_nice, cores=cost.device.cores))
    capacity = MESH_KV_CACHE_BYTES // cost.kv_bytes_per_token
    return Topology(
        mode,  # type: ignore[arg-type]
        num_decode=1,
        num_prefill=1 if mode == "disagg" else 0,
        chunk_tokens=MESH_CHUNK_TOKENS,
        max_num_seqs=MESH_MAX_NUM_SEQS,
        kv_capacity_tokens=capacity,
        shared_device=True,
        decode_threads=threads.get("decode", threads.get("colocated")),
        prefill_threads=threads.get("prefill"),
        prefill_nice=prefill_nice if mode == "disagg" else 0,
    )


def scrape(urls: list[str]) -> dict[str, float] | None:
    """Every service's ``/metrics`` summed by name; None if one cannot be read."""
    import urllib.request

    from kvmesh.loadgen.server_breakdown import parse_prometheus

    scrapes = []
    for url in urls:
        try:
            with urllib.request.urlopen(url, timeout=5.0) as resp:
                scrapes.append(parse_prometheus(resp.read().decode()))
        except OSError:
            return None
    return merge_scrapes(scrapes)


@dataclass(frozen=True, slots=True)
class RealRun:
    records: list[RequestRecord]
    duration_s: float
    timings: EngineTimings | None


def run_real(config: ServeBenchConfig, mode: str) -> RealRun:
    from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times
    from kvmesh.loadgen.bench_mesh import local_mesh
    from kvmesh.loadgen.bench_serve import build_workload
    from kvmesh.loadgen.sse_client import run_requests

    prompts, _ = build_workload(config)
    process = ArrivalProcess(config.arrival, config.request_rates[0], config.burstiness)
    times = arrival_times(process, len(prompts), random.Random(f"{config.seed}:arrivals"))
    with local_mesh(
        mode,
        config.transport,
        model=config.model,
        local_prefill_threshold=0,
        prefill_nice=config.prefill_nice,
    ) as mesh:
        endpoint = config.endpoint(mesh.url)
        # a prompt of its own (prompts[0] reversed): the warm-up must not leave the first
        # request's prompt in the prefix cache, which the simulator does not model
        warm = dataclasses.replace(
            prompts[0], token_ids=prompts[0].token_ids[::-1], text=None, output_len=4
        )
        asyncio.run(run_requests(endpoint, [warm], [0.0], timeout_s=config.timeout_s))
        urls = list(mesh.metrics_urls.values())
        before = scrape(urls)
        records, duration_s = asyncio.run(
            run_requests(endpoint, prompts, times, timeout_s=config.timeout_s)
        )
        after = scrape(urls)
    timings = None if before is None or after is None else EngineTimings.between(before, after)
    return RealRun(records, duration_s, timings)


def compare(
    config: ServeBenchConfig, cost: CostModel, requests: list[SimRequest], modes: tuple[str, ...]
) -> list[Comparison]:
    out = []
    for mode in modes:
        run = run_real(config, mode)
        real = summarize(run.records, run.duration_s)
        topology = mesh_topology(mode, cost, config.prefill_nice)
        sim = simulate(topology, cost, requests)
        out.append(
            Comparison(
                mode,
                real,
                sim.summary,
                tuple(run.records),
                sim.records,
                run.timings,
                sim.timings,
            )
        )
    return out


def records_json(comparisons: list[Comparison]) -> str:
    """Every request's real and simulated record (token times included), by mode."""
    import json

    def record(r: RequestRecord) -> dict[str, object]:
        return {
            "index": r.index,
            "arrival_s": r.arrival_s,
            "send_s": r.send_s,
            "end_s": r.end_s,
            "prompt_len": r.prompt_len,
            "output_len": r.output_len,
            "chunk_times": list(r.chunk_times),
            "error": r.error,
        }

    return json.dumps(
        {
            c.mode: {
                "real": [record(r) for r in c.real_records],
                "sim": [record(r) for r in c.sim_records],
                "real_timings": c.real_timings and dataclasses.asdict(c.real_timings),
                "sim_timings": c.sim_timings and dataclasses.asdict(c.sim_timings),
            }
            for c in comparisons
        },
        indent=1,
    )


def format_comparisons(comparisons: list[Comparison]) -> str:
    def ms(stats, attr: str) -> str:
        return "-" if stats is None else f"{getattr(stats, attr):.0f}"

    lines = [
        "| mode | | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for name, s in (("real", c.real), ("sim", c.sim)):
            cells = [
                ms(s.ttft, "p50_ms"),
                ms(s.ttft, "p99_ms"),
                ms(s.itl, "p50_ms"),
                ms(s.itl, "p99_ms"),
            ]
            lines.append(f"| {c.mode} | {name} | {' | '.join(cells)} | {s.num_failed} |")
        ratios = [("-" if r is None else f"{r:.2f}x") for r in c.ratios().values()]
        lines.append(f"| {c.mode} | sim/real | {' | '.join(ratios)} | |")
    return "\n".join(lines)
