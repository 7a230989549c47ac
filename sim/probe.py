"""The mesh probe: a small calibration workload that a real local mesh serves, so that calibration
can measure what the mesh adds to the engine (``overheads.py`` fits it).

It is not the validation workload: short prompts, few requests, two phases per mesh mode:

- *isolated*: ``ISOLATED`` requests of ``PROBE_INPUT`` prompt tokens and ``ISOLATED_OUTPUT``
  output tokens, each sent once the previous one has finished. A request alone on an idle mesh:
  its TTFT is the request path's fixed latency plus one short prefill; its gaps are the decode
  loop's period at batch 1;
- *batch*: ``BATCH`` requests of the same prompts and ``BATCH_OUTPUT`` output tokens sent at once:
  their gaps are the loop's period at batch ``BATCH`` (most of them; the first steps also
  prefill);
- *long*: ``LONG`` requests of ``LONG_INPUT`` prompt tokens (``LONG_OUTPUT`` output tokens), one
  at a time, after the isolated ones. Nothing is fitted to them: their median TTFT is a check of
  the fitted simulator on prompts as long as a serving workload's (the short probe prompts
  cannot show a cost that grows with the prompt outside the engine's calibrated prefill);
- *woken*: ``LONG`` more such requests, each sent after the mesh has idled ``WAKE_PAUSE_S``,
  last (after the batch). Every other phase sends each request as soon as the previous one
  has ended; a serving workload's requests mostly reach a mesh that has idled, and on this
  2-core VM a 1,024-token prompt then took 25-30 % longer (colocated; 13-15 % disagg). Their
  median TTFT against the long prompts' is what the wake terms are fitted to
  (``overheads.fit_wake``).

The mesh's own ``/metrics`` are read after the warm-up, after the long prompts and after the
batch: the engine means of the long prompts' phase (``ProbeRecords.long_timings``: prefill chunks
mostly) and of the rest (``ProbeRecords.short_timings``: the isolated requests and the batch,
decode steps mostly) are what ``engine_scale.py`` fits the engine's slowdown in the mesh to.

The same requests, as ``SimRequest``s (``probe_requests``), are what the simulator replays when
it fits the overheads. The real side uses ``kvmesh bench serve``'s client (``sse_client``) and
``kvmesh.testing.mesh.local_mesh`` as ``--validate`` does (torch and the services, imported lazily).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from kvmesh.loadgen.serve_metrics import RequestRecord
from kvmesh.sim.engine_timings import EngineTimings, pooled
from kvmesh.sim.workload import SimRequest

PROBE_INPUT = 64
ISOLATED = 8
ISOLATED_OUTPUT = 128
BATCH = 8
BATCH_OUTPUT = 64
LONG_INPUT = 1024  # two 512-token chunks and a few blocks, as the mesh cuts them
LONG = 3
LONG_OUTPUT = 16  # 15 gaps: the first ones against the second half give the warm-up term
WAKE_PAUSE_S = 0.5  # the idle time before each woken request (cost.WAKE_AFTER_S or more)
ISOLATION_GAP_S = 60.0  # simulated isolated requests are this far apart: nothing overlaps


@dataclass(frozen=True, slots=True)
class ProbeRecords:
    """One mesh mode's probe: the isolated requests' records and the batch's."""

    mode: str
    isolated: tuple[RequestRecord, ...]
    batch: tuple[RequestRecord, ...]
    long: tuple[RequestRecord, ...] = ()
    # the mesh's engine means over the isolated and batch phases, and over the long phase;
    # None: its /metrics could not be read
    short_timings: EngineTimings | None = None
    long_timings: EngineTimings | None = None
    woken: tuple[RequestRecord, ...] = ()  # long prompts each sent to a mesh idle for a while


def probe_requests() -> tuple[list[SimRequest], list[SimRequest]]:
    """The probe's isolated requests (far apart) and its batch (all at 0), as the simulator runs
    them."""
    isolated = [
        SimRequest(i * ISOLATION_GAP_S, PROBE_INPUT, ISOLATED_OUTPUT) for i in range(ISOLATED)
    ]
    batch = [SimRequest(0.0, PROBE_INPUT, BATCH_OUTPUT) for _ in range(BATCH)]
    return isolated, batch


def long_requests() -> list[SimRequest]:
    """The probe's long-prompt requests (far apart), as the simulator runs them."""
    return [SimRequest(i * ISOLATION_GAP_S, LONG_INPUT, LONG_OUTPUT) for i in range(LONG)]


def run_probe(
    mode: str, model: str, transport: str = "shm", timeout_s: float = 120.0
) -> ProbeRecords:
    """Serve the probe on a fresh local mesh of ``mode`` (the ``--validate`` mesh's settings)."""
    from kvmesh.testing.mesh import local_mesh

    with local_mesh(mode, transport, model=model, local_prefill_threshold=0) as mesh:
        return serve_probe(mesh, mode, model, timeout_s)


def serve_probe(
    mesh: Any, mode: str, model: str, timeout_s: float = 120.0, seed: str = "probe"
) -> ProbeRecords:
    """Serve the probe on ``mesh``, an open local mesh of ``mode`` (``local_mesh``'s Launcher:
    ``.url``, ``.metrics_urls``) running ``model``: a warm-up, then the isolated requests, the
    long prompts and the batch, the mesh's /metrics read between the phases. Apart from
    ``run_probe`` so that ``--validate --probe-each-run`` can probe the very mesh it then
    validates on. ``seed`` draws the prompts: a second probe on the same mesh takes another, so
    that none of its prompts is in the prefix cache."""
    from kvmesh.loadgen.sse_client import SseEndpoint, run_requests
    from kvmesh.loadgen.workload import WorkloadPrompt
    from kvmesh.sim.validate import scrape

    rng = random.Random(seed)
    # one prompt per request and one for the warm-up: none is in the prefix cache when sent
    prompts = [
        tuple(rng.randrange(1, 250) for _ in range(PROBE_INPUT))
        for _ in range(ISOLATED + BATCH + 1)
    ]
    long_prompts = [tuple(rng.randrange(1, 250) for _ in range(LONG_INPUT)) for _ in range(LONG)]
    woken_prompts = [tuple(rng.randrange(1, 250) for _ in range(LONG_INPUT)) for _ in range(LONG)]
    endpoint = SseEndpoint(mesh.url, model)

    def serve(batch: list[WorkloadPrompt]) -> list[RequestRecord]:
        records, _ = asyncio.run(
            run_requests(endpoint, batch, [0.0] * len(batch), timeout_s=timeout_s)
        )
        failed = [r for r in records if r.error is not None]
        if failed:
            raise RuntimeError(
                f"the {mode} mesh failed a probe request: {failed[0].error} {failed[0].detail}"
            )
        return records

    serve([WorkloadPrompt(prompts[-1], 4)])  # warm-up: first steps, connections
    urls = list(mesh.metrics_urls.values())
    scrapes = [scrape(urls)]
    isolated = [serve([WorkloadPrompt(p, ISOLATED_OUTPUT)])[0] for p in prompts[:ISOLATED]]
    scrapes.append(scrape(urls))
    long = [serve([WorkloadPrompt(p, LONG_OUTPUT)])[0] for p in long_prompts]
    scrapes.append(scrape(urls))
    batch = serve([WorkloadPrompt(p, BATCH_OUTPUT) for p in prompts[ISOLATED:-1]])
    scrapes.append(scrape(urls))
    woken = []
    for p in woken_prompts:
        time.sleep(WAKE_PAUSE_S)
        woken += serve([WorkloadPrompt(p, LONG_OUTPUT)])
    short = long_timings = None
    if all(s is not None for s in scrapes):
        a, b, c, d = scrapes
        short = pooled([EngineTimings.between(a, b), EngineTimings.between(c, d)])  # type: ignore[arg-type]
        long_timings = EngineTimings.between(b, c)  # type: ignore[arg-type]
    return ProbeRecords(
        mode, tuple(isolated), tuple(batch), tuple(long), short, long_timings, tuple(woken)
    )
