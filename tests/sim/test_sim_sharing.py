"""A shared CPU host: cores divided by threads and niceness, gang-paced OpenMP workers."""

from __future__ import annotations

import pytest
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.sharing import Share, SharedHost
from kvmesh.sim.specs import DeviceSpec, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.validate import mesh_topology
from kvmesh.sim.workload import SimRequest

DECODE, PREFILL = 0, 1


def _busy(host: SharedHost, *workers: tuple[int, Share, float, float]) -> dict[int, float]:
    for w, share, overhead, roofline in workers:
        host.start(w, share, overhead, roofline, 0.0)
    return host.rates()


def test_one_thread_decode_beside_two_thread_prefill_halves_both():
    # 3 threads on 2 cores: decode shares a core with one prefill thread; the other prefill
    # thread waits for it at every barrier, so prefill runs at half its speed
    rates = _busy(SharedHost(2, 2), (DECODE, Share(1), 0.0, 1.0), (PREFILL, Share(2), 0.0, 1.0))
    assert rates[PREFILL] == pytest.approx(0.5)
    assert rates[DECODE] == pytest.approx(0.5 / 2)  # half a core of the 2 calibrated threads


def test_alone_a_worker_runs_its_overhead_on_one_core_and_roofline_on_its_threads():
    host = SharedHost(2, 2)
    assert _busy(host, (DECODE, Share(1), 1.0, 1.0))[DECODE] == pytest.approx(1.0)
    done, ends = host.phase_done(DECODE, 1.0)
    assert not done and ends[DECODE] == pytest.approx(1.0 + 2.0)  # 1 thread of 2: half speed
    done, ends = host.phase_done(DECODE, 3.0)
    assert done and not ends


def test_nicer_prefill_leaves_decode_nearly_all_of_its_cores():
    rates = _busy(
        SharedHost(2, 2), (DECODE, Share(2), 0.0, 1.0), (PREFILL, Share(2, nice=10), 0.0, 1.0)
    )
    assert rates[DECODE] == pytest.approx(1024 / (1024 + 1024 / 1.25**10))  # ~0.90
    assert rates[PREFILL] == pytest.approx(1 - rates[DECODE])


def test_one_core_one_thread_workers_share_equally():
    rates = _busy(SharedHost(), *((w, Share(1), 0.0, 1.0) for w in range(3)))
    assert rates == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})


def test_disagg_decode_alone_on_a_shared_host_pays_its_overhead_at_full_speed():
    # every step is 10 ms of overhead and nothing else; the prefill is over before decoding
    device = DeviceSpec(
        "cpu2", 1e30, 1e30, 1e12, 1e30, step_overhead_s=0.01, cores=2, calibration_threads=2
    )
    cost = CostModel(load_model("kvmesh-tiny"), device)
    topology = mesh_topology("disagg", cost)
    assert (topology.decode_threads, topology.prefill_threads) == (1, 1)  # a core each
    result = simulate(topology, cost, [SimRequest(0.0, 100, 20)])
    assert result.records[0].itl_s == pytest.approx([0.01] * 19)


def test_mesh_topology_mirrors_kvmesh_up_threads_and_niceness():
    device = DeviceSpec("cpu2", 1e10, 1e10, 1e12, 1e9, cores=2, calibration_threads=2)
    cost = CostModel(load_model("kvmesh-tiny"), device)
    colocated = mesh_topology("colocated", cost)
    assert colocated.decode_threads == 2 and colocated.prefill_nice == 0
    nice = mesh_topology("disagg", cost, prefill_nice=10)
    assert (nice.decode_threads, nice.prefill_threads, nice.prefill_nice) == (2, 2, 10)


def test_topology_refuses_a_niceness_out_of_range():
    with pytest.raises(ValueError, match="prefill_nice"):
        Topology("disagg", 1, 1, shared_device=True, prefill_nice=20)
