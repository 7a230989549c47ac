"""Test helpers for the simulator's calibration on a mesh: a device of fixed-cost steps, one
whose chunk transfers take half a step, a CPU-like engine spec, and the probe a mesh behaving as a cost model would serve (the simulator
stands in for the real mesh)."""

from __future__ import annotations

from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.engine_scale import simulate_probe_timings
from kvmesh.sim.probe import ProbeRecords, long_requests, probe_requests
from kvmesh.sim.specs import DeviceSpec, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.validate import mesh_topology


def fixed_steps(**fields: object) -> CostModel:
    """kvmesh-tiny on a device whose steps cost 10 ms of fixed overhead only (no compute, no
    memory, an instant link), with ``fields`` on top."""
    device = DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=0.01, **fields)
    return CostModel(load_model("kvmesh-tiny"), device)


def slow_link_disagg() -> tuple[CostModel, Topology]:
    """kvmesh-tiny disaggregated (a prefill worker and a decode worker) where each step costs
    its 1 s overhead and a 1000-token chunk's KV takes 0.5 s on the link; plain 1000-token chunks
    (not cut on blocks)."""
    model = load_model("kvmesh-tiny")
    device = DeviceSpec(
        "slow-link",
        1e30,
        1e30,
        1e30,
        link_bandwidth=1000 * model.kv_bytes_per_token / 0.5,
        step_overhead_s=1.0,
    )
    topology = Topology(
        "disagg", 1, 1, chunk_tokens=1000, kv_capacity_tokens=10_000, block_tokens=None
    )
    return CostModel(model, device), topology


def cpu_like(**fields: float) -> DeviceSpec:
    """A 2-core CPU-like engine (the figures ``--calibrate`` measures), with ``fields`` (mesh
    terms, scales) on top."""
    return DeviceSpec(
        "cpu-like",
        peak_flops=100e9,
        mem_bandwidth=8e9,
        memory_bytes=16e9,
        link_bandwidth=2.5e9,
        step_overhead_s=0.0007,
        cache_bytes=32 << 20,
        cores=2,
        calibration_threads=2,
        **fields,
    )


def simulated_probe(mode: str, cost: CostModel) -> ProbeRecords:
    """The probe of ``mode`` as a mesh behaving as ``cost`` serves it on ``mesh_topology``:
    records (its phases back to back: no wake) and phase timings."""
    isolated, batch = probe_requests()
    topology = mesh_topology(mode, cost)
    timings = simulate_probe_timings(mode, cost, lambda m, c: mesh_topology(m, c))
    return ProbeRecords(
        mode,
        simulate(topology, cost, isolated, wake=False).records,
        simulate(topology, cost, batch, wake=False).records,
        simulate(topology, cost, long_requests(), wake=False).records,
        timings.short,
        timings.long,
    )
