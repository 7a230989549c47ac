"""Tensor parallelism on GPUs (issue 44): two rank processes, one GPU each, in an NCCL group
(``join_group`` with a CUDA device, as ``kvmesh serve prefill|decode --tp 2 --device cuda``
starts them), give TP1's greedy tokens on kvmesh-tiny and on a model of SmolLM2-135M's head
counts (9 heads, 3 KV heads: 2 + 1 GQA groups per rank).

``gpu``-marked: skipped without CUDA, and without two GPUs; `make gpu-check` runs them. Never
yet run on real hardware (docs/gpu.md)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp
from kvmesh.shared.config.ports import free_port
from kvmesh.shared.engine.tp_ranks import rank_device

pytestmark = pytest.mark.gpu


def _tokens(model, device: str) -> list[list[int]]:
    from support.tp_ranks import run_engine

    return run_engine(model, device)["tokens"]


def _model(name: str, device: str):
    from support.tp_ranks import tiny_model, uneven_model

    return (tiny_model(None) if name == "tiny" else uneven_model()).to(device)


def _rank(rank: int, port: int, name: str, queue) -> None:
    import torch.distributed as dist
    from kvmesh.shared.engine.tp_ranks import join_group
    from kvmesh.shared.model.tensor_parallel import shard_model

    device = rank_device("cuda", rank)
    join_group(rank, 2, port, device)
    try:
        model = _model(name, device)
        layout = shard_model(model)
        queue.put((rank, pickle.dumps((_tokens(model, device), layout.kv_heads))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["tiny", "uneven"])
def test_tp2_over_nccl_gives_tp1_greedy_tokens(name):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP2 over NCCL needs two GPUs; this machine has {torch.cuda.device_count()}")
    expected = _tokens(_model(name, "cuda:0"), "cuda:0")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, name, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    tokens0, heads0 = pickle.loads(results[0])
    tokens1, heads1 = pickle.loads(results[1])
    assert tokens0 == tokens1 == expected
    if name == "uneven":
        assert (heads0, heads1) == ((0, 2), (2, 3))  # 2 + 1 GQA groups
