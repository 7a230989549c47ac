"""One validation run on a real local mesh (``run_real``) and what it keeps (``RealRun``): the
workload's records, the engines' means from the mesh's ``/metrics`` (``scrape``), the probes it
served before and after the workload, and the CPU the VM's hypervisor took meanwhile
(``Steal``). validate.py says how the runs are served and compared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.engine_timings import EngineTimings, merge_scrapes
from kvmesh.sim.probe import ProbeRecords


def scrape(urls: list[str]) -> dict[str, float] | None:
    """Every service's ``/metrics`` summed by name; None if one cannot be read."""
    from kvmesh.loadgen import prom_text

    scrapes = []
    for url in urls:
        try:
            scrapes.append(prom_text.scrape(url, timeout_s=5.0))
        except OSError:
            return None
    return merge_scrapes(scrapes)


@dataclass(frozen=True, slots=True)
class Steal:
    """The CPU time a VM's hypervisor took (``cpu_steal``) during a real run's probes and
    during its workload (None: not measured, or no /proc/stat)."""

    probes: float | None = None
    workload: float | None = None

    def cell(self) -> str:
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{x:.0%}"

        return f"{pct(self.probes)} / {pct(self.workload)}"


@dataclass(frozen=True, slots=True)
class RealRun:
    """One mesh's validation run: its records, how long it took, the engines' means over it
    (None: its /metrics were unread), and the probes it served before and after the workload
    (none: not probed)."""

    records: list[RequestRecord]
    duration_s: float
    timings: EngineTimings | None
    probes: tuple[ProbeRecords, ...] = ()  # the probe before the workload and after it
    steal: Steal = Steal()  # the hypervisor's share of the CPU meanwhile


def run_real(config: ServeBenchConfig, mode: str, probe: bool = False) -> RealRun:
    """Serve the workload on a fresh local mesh of ``mode``; with ``probe``, serve the
    calibration probe on that mesh before the warm-up and the workload, and again (other
    prompts) after them."""
    from kvmesh.loadgen.arrivals import ArrivalProcess, arrival_times
    from kvmesh.loadgen.cpu_steal import CpuTimes, read_cpu_times, steal_share, steal_share_over
    from kvmesh.loadgen.serve_prompts import build_workload
    from kvmesh.loadgen.sse_client import run_requests
    from kvmesh.sim.probe import serve_probe

    from kvmesh.testing.mesh import local_mesh

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
        probe_spans: list[tuple[CpuTimes | None, CpuTimes | None]] = []

        def probed(seed: str) -> ProbeRecords:
            before = read_cpu_times()
            records = serve_probe(mesh, mode, config.model, config.timeout_s, seed=seed)
            probe_spans.append((before, read_cpu_times()))
            return records

        probes = [probed("probe")] if probe else []
        endpoint = config.endpoint(mesh.url)
        # a prompt of its own (prompts[0] reversed): the warm-up must not leave the first
        # request's prompt in the prefix cache, which the simulator does not model
        warm = dataclasses.replace(
            prompts[0], token_ids=prompts[0].token_ids[::-1], text=None, output_len=4
        )
        asyncio.run(run_requests(endpoint, [warm], [0.0], timeout_s=config.timeout_s))
        urls = list(mesh.metrics_urls.values())
        before = scrape(urls)
        started = read_cpu_times()
        records, duration_s = asyncio.run(
            run_requests(endpoint, prompts, times, timeout_s=config.timeout_s)
        )
        ended = read_cpu_times()
        after = scrape(urls)
        if probe:
            probes.append(probed("probe-after"))
    timings = None if before is None or after is None else EngineTimings.between(before, after)
    steal = Steal(steal_share_over(probe_spans), steal_share(started, ended))
    return RealRun(records, duration_s, timings, tuple(probes), steal)
