"""Qualitative behaviour of the simulated cluster: interference, overlap, queueing."""

from __future__ import annotations

import pytest
from kvmesh.sim.cluster import simulate
from kvmesh.sim.cost import CostModel
from kvmesh.sim.specs import DeviceSpec, load_device, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import SimRequest
from support.sim_probe_fakes import slow_link_disagg

H100_8B = CostModel(load_model("llama-3-8b"), load_device("h100"))
# a short stream decoding when a 32k-token prompt arrives
STREAM_AND_LONG_PROMPT = [SimRequest(0.0, 100, 300), SimRequest(0.5, 32_000, 10)]


def _max_gap(result, index):
    return max(result.records[index].itl_s)


def test_long_prompt_inflates_colocated_itl_without_chunking():
    result = simulate(Topology("colocated", 1, chunk_tokens=None), H100_8B, STREAM_AND_LONG_PROMPT)
    long_ttft = result.records[1].ttft_s
    # the stream's gap while the prompt prefilled is about the whole prefill (> 1 s)
    assert _max_gap(result, 0) > 1.0
    assert _max_gap(result, 0) == pytest.approx(long_ttft, rel=0.1)


def test_long_prompt_leaves_disaggregated_itl_alone():
    result = simulate(Topology("disagg", 1, 1, chunk_tokens=2048), H100_8B, STREAM_AND_LONG_PROMPT)
    gaps = result.records[0].itl_s
    assert result.records[1].ttft_s > 1.0  # the prompt still takes its prefill time
    assert max(gaps) < 2 * min(gaps)  # the stream never stalls: a second sequence at most


def test_chunked_colocated_spreads_the_stall_over_many_steps():
    unchunked = simulate(
        Topology("colocated", 1, chunk_tokens=None), H100_8B, STREAM_AND_LONG_PROMPT
    )
    chunked = simulate(Topology("colocated", 1, chunk_tokens=2048), H100_8B, STREAM_AND_LONG_PROMPT)
    assert _max_gap(chunked, 0) < _max_gap(unchunked, 0) / 5
    slow = [g for g in chunked.records[0].itl_s if g > 0.03]
    assert len(slow) >= 32_000 // 2048  # one slow gap per chunk


def test_chunk_transfers_overlap_the_next_chunks_compute():
    # each step costs its 1 s overhead; a 1000-token chunk's KV takes 0.5 s on the link; plain
    # 1000-token chunks (not cut on blocks: test_sim_overheads covers hand-off chunks)
    cost, topology = slow_link_disagg()
    result = simulate(topology, cost, [SimRequest(0.0, 4000, 2)])
    # four chunks computed back to back; only the last chunk's transfer is exposed
    assert result.records[0].ttft_s == pytest.approx(4 * 1.0 + 0.5)


def test_requests_wait_for_kv_room_instead_of_failing():
    model = load_model("kvmesh-tiny")
    device = DeviceSpec("fixed", 1e30, 1e30, 1e30, 1e30, step_overhead_s=1.0)
    # room for one request's prompt and output at a time
    topology = Topology("colocated", 1, chunk_tokens=None, kv_capacity_tokens=150)
    requests = [SimRequest(0.0, 100, 3), SimRequest(0.0, 100, 3)]
    result = simulate(topology, CostModel(model, device), requests)
    first, second = result.records
    assert first.is_ok and second.is_ok
    assert second.ttft_s == pytest.approx(first.e2e_s + 1.0)  # placed when the first one ended


def test_prompt_that_can_never_fit_fails_as_too_long():
    model = load_model("kvmesh-tiny")
    topology = Topology("colocated", 1, kv_capacity_tokens=100)
    result = simulate(topology, CostModel(model, load_device("h100")), [SimRequest(0.0, 200, 3)])
    assert result.records[0].error == "too_long"
    assert result.summary.num_failed == 1
