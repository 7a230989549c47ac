"""kv_linear_rows (kernels/cpu_linear.c): x @ w.T over a row-major float32 weight read in place,
the float32 tied LM head of the CPU backend (cpu_modules.CpuEmbedding)."""

import dataclasses

import pytest
import torch
from kvmesh.shared.model.backend import CpuBackend
from kvmesh.shared.model.cpu_modules import CpuEmbedding, remove_cpu_kernels
from kvmesh.shared.model.llama import Embedding
from support.cpu_layers import layer_config, random_model


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "threads"),
    [
        (1, 576, 203, 1),  # whole vectors of x; rows left over after the 4 runs
        (2, 100, 64, 2),  # a vector's tail of x in scalars
        (5, 48, 37, 3),  # rows of x past one tile; a thread with fewer rows than runs
        (9, 7, 5, 2),
    ],
)
def test_linear_rows_matches_float64(ops, rows, in_features, out_features, threads):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = ops.linear_rows(x, w)
    finally:
        torch.set_num_threads(before)
    exact = (x.double() @ w.double().T).float()
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-4)


def test_linear_rows_do_not_depend_on_the_rows_beside_them(ops):
    # a sequence's logits are the same whatever batch it decodes in
    g = torch.Generator().manual_seed(5)
    w = torch.randn(131, 80, generator=g)
    x = torch.randn(9, 80, generator=g)
    alone = torch.cat([ops.linear_rows(x[r : r + 1], w) for r in range(9)])
    for m in (2, 3, 4, 5, 8, 9):
        assert torch.equal(ops.linear_rows(x[:m], w), alone[:m]), m


def test_linear_rows_refuses_a_strided_weight(ops):
    with pytest.raises(AssertionError, match="contiguous"):
        ops.linear_rows(torch.randn(1, 4), torch.randn(4, 6).t())


def test_cpu_backend_reads_a_tied_float32_head_in_place(ops):
    config = dataclasses.replace(layer_config(32, 64, 4, 2, 8, False), tie_word_embeddings=True)
    model = random_model(config)
    hidden = torch.randn(3, 32)
    expected = model.compute_logits(hidden)
    CpuBackend(ops).install(model)
    assert type(model.tok_embeddings) is CpuEmbedding
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    CpuBackend(ops).install(model)  # installed again: removed first, then put back
    assert type(model.tok_embeddings) is CpuEmbedding
    remove_cpu_kernels(model)
    assert type(model.tok_embeddings) is Embedding
