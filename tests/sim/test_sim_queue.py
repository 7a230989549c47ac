"""The event loop against queueing theory: one worker serving one request at a time with a
fixed service time under Poisson arrivals is an M/D/1 queue, whose mean wait is known in closed
form (Pollaczek-Khinchine): W = rho * D / (2 * (1 - rho))."""

from __future__ import annotations

import pytest
from kvmesh.loadgen.arrivals import ArrivalProcess
from kvmesh.loadgen.workload import LengthSpec
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.specs import DeviceSpec, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import synthetic

# compute and memory are free; every step costs its 1 s overhead: a deterministic server
FIXED = DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=1.0)


@pytest.mark.slow  # seconds: left out of make test-fast
@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_worker_mean_wait_matches_md1_closed_form(rho):
    cost = CostModel(load_model("kvmesh-tiny"), FIXED)
    # one output token: a request is one prefill step (its TTFT is wait + 1 s), then gone
    topology = Topology("colocated", num_decode=1, chunk_tokens=None, max_num_seqs=1)
    requests = synthetic(
        ArrivalProcess("poisson", rho), 40_000, LengthSpec(64, 64), LengthSpec(1, 1), seed=3
    )
    result = simulate(topology, cost, requests)
    ttfts = [r.ttft_s for r in result.records]
    mean_wait = sum(ttfts) / len(ttfts) - 1.0
    assert mean_wait == pytest.approx(rho / (2 * (1 - rho)), rel=0.05)


def test_shared_device_halves_the_speed_of_two_busy_workers():
    cost = CostModel(load_model("kvmesh-tiny"), FIXED)
    topology = Topology(
        "colocated", num_decode=2, chunk_tokens=None, max_num_seqs=1, shared_device=True
    )
    # two requests at once land on the two workers (most free KV first) and share the device
    requests = synthetic(
        ArrivalProcess("poisson", float("inf")), 2, LengthSpec(64, 64), LengthSpec(1, 1)
    )
    result = simulate(topology, cost, requests)
    assert [r.ttft_s for r in result.records] == pytest.approx([2.0, 2.0])
