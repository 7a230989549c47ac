"""The planner picks the split with the highest SLA goodput, and leans the way the load leans."""

from __future__ import annotations

from kvmesh.loadgen.arrivals import ArrivalProcess
from kvmesh.loadgen.workload import LengthSpec
from kvmesh.sim.cost import CostModel
from kvmesh.sim.planner import evaluate, explain, plan
from kvmesh.sim.sla import Sla
from kvmesh.sim.specs import load_device, load_model
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import synthetic

COST = CostModel(load_model("llama-3-8b"), load_device("h100"))
SLA = Sla(ttft_ms=1500, itl_ms=30)


def _requests(prompt: LengthSpec, output: LengthSpec, rate: float, num: int = 60):
    return synthetic(ArrivalProcess("poisson", rate), num, prompt, output, seed=1)


def test_planner_best_is_the_argmax_of_every_split_on_a_toy_case():
    requests = _requests(LengthSpec(8000, 16000), LengthSpec(64, 64), rate=8.0, num=100)
    result = plan(COST, requests, SLA, 4, chunk_sizes=(2048,))
    brute = [
        evaluate(Topology("disagg", num_decode=4 - p, num_prefill=p), COST, requests, SLA)
        for p in range(1, 4)
    ]
    assert result.best.sla_goodput == max(c.sla_goodput for c in brute)
    # long prompts and short outputs: prefill is the work, so prefill gets most GPUs
    assert result.best.topology.num_prefill > result.best.topology.num_decode


def test_planner_gives_decode_the_gpus_when_outputs_dominate():
    requests = _requests(LengthSpec(500, 1000), LengthSpec(1024, 1024), rate=8.0, num=80)
    result = plan(COST, requests, SLA, 4, chunk_sizes=(2048,))
    assert result.best.topology.num_decode > result.best.topology.num_prefill


def test_planner_explains_its_choice_against_its_neighbours():
    requests = _requests(LengthSpec(8000, 16000), LengthSpec(64, 64), rate=4.0)
    result = plan(COST, requests, SLA, 4, chunk_sizes=(1024, 2048))
    lines = explain(result)
    best = result.best.topology
    assert lines[0].startswith(f"planner: {best.num_prefill} prefill + {best.num_decode} decode")
    assert any("chunk sizes on this split" in line for line in lines)
    assert {c.topology.chunk_tokens for c in result.chunks} == {1024, 2048}
