"""shared/model/quant.py: weights in their GGUF block format, held to the gguf package's own
quantizers and dequantizers (ggml's reference arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvmesh.shared.model.quant import (
    QUANT_FORMATS,
    QuantWeight,
    cat_rows,
    dequantize,
    quantize,
)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero block: scale 0
    w[1, 5] = 3.0  # an outlier
    return w


@pytest.mark.parametrize("format", QUANT_FORMATS)
def test_quantize_matches_gguf_bit_for_bit(format: str) -> None:
    w = _weight(37, 96, seed=1)
    ours = quantize(w, format)
    theirs = gguf_quants.quantize(w.numpy(), GGMLQuantizationType[format])
    assert ours.data.shape == theirs.shape
    assert np.array_equal(ours.data.numpy(), theirs)


@pytest.mark.parametrize("format", QUANT_FORMATS)
def test_dequantize_matches_gguf(format: str) -> None:
    w = _weight(19, 160, seed=2)
    q = quantize(w, format)
    expected = gguf_quants.dequantize(q.data.numpy(), GGMLQuantizationType[format])
    assert torch.equal(dequantize(q), torch.from_numpy(np.asarray(expected, dtype=np.float32)))
    # and the round trip is close to the float weight: half a step of each block at most
    step = {"Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 15, "Q5_0": 1 / 15, "Q5_1": 1 / 31}[format]
    span = w.reshape(19, 5, 32).abs().amax(-1, keepdim=True) * 2
    err = (dequantize(q) - w).abs().reshape(19, 5, 32)
    assert (err <= span * step + 1e-3).all()


def test_rows_select_and_concatenate_as_bytes() -> None:
    a, b = quantize(_weight(4, 64, 3), "Q4_1"), quantize(_weight(6, 64, 4), "Q4_1")
    both = cat_rows([a, b])
    assert both.shape == (10, 64)
    assert torch.equal(dequantize(both), torch.cat([dequantize(a), dequantize(b)]))
    picked = both.select_rows(torch.tensor([7, 0]))
    assert torch.equal(dequantize(picked), dequantize(both)[[7, 0]])


def test_quant_weight_refuses_a_shape_its_bytes_do_not_hold() -> None:
    with pytest.raises(AssertionError):
        QuantWeight("Q8_0", torch.zeros(4, 33, dtype=torch.uint8), 4, 32)


@pytest.mark.parametrize("format", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("cols", [64, 96])  # an even and an odd number of blocks
def test_paired_layout_holds_the_same_values_in_the_same_bytes(format: str, cols: int) -> None:
    from kvmesh.shared.model.quant import BLOCK_BYTES, GROUP
    from kvmesh.shared.model.quant_paired import pair_blocks, unpair_blocks

    g = torch.Generator().manual_seed(cols)
    weight = quantize(torch.randn(GROUP + 5, cols, generator=g), format)  # a group and 5 rows
    paired = pair_blocks(weight)
    assert paired.paired and paired.data.shape == weight.data.shape
    assert not torch.equal(paired.data, weight.data)
    assert torch.equal(unpair_blocks(paired).data, weight.data)
    assert torch.equal(dequantize(paired), dequantize(weight))
    index = torch.tensor([20, 3, 16, 3, 0, 15])  # a lookup across the group and the rest
    assert torch.equal(paired.select_rows(index).data, weight.select_rows(index).data)
    head, bb = (4 if format in ("Q4_1", "Q5_1") else 2), BLOCK_BYTES[format]
    q5 = format.startswith("Q5")
    # the group's first block: its 16 d (16 m), Q5's 8 masks of fifth bits (mask j's bit 4c + t:
    # row c's value 4j + t), then chunk i's bytes 4c + j = row c's value bytes 4i + j
    group = paired.data[:GROUP].flatten()[: GROUP * bb]
    first = weight.data[:GROUP, :bb]
    scales = [first[:, i : i + 2].flatten() for i in range(0, head, 2)]
    fifth = []
    if q5:
        qh = [
            int.from_bytes(bytes(first[c, head : head + 4].tolist()), "little")
            for c in range(GROUP)
        ]
        masks = [
            sum(((qh[c] >> (4 * j + t)) & 1) << (4 * c + t) for c in range(GROUP) for t in range(4))
            for j in range(8)
        ]
        fifth = [
            torch.tensor(list(b"".join(m.to_bytes(8, "little") for m in masks)), dtype=torch.uint8)
        ]
    values = first[:, head + 4 * q5 :].reshape(GROUP, -1, 4).transpose(0, 1).flatten()
    values = values ^ 0x80 if format == "Q8_0" else values  # Q8_0's q + 128, unsigned
    assert torch.equal(group, torch.cat([*scales, *fifth, values]))
    rest, paired_rest = weight.data[GROUP:], paired.data[GROUP:]
    if format in ("Q8_0", "Q5_0", "Q5_1"):  # its rows left over as they were
        assert torch.equal(paired_rest, rest)
    else:  # the first pair of a row left over: dA, dB (mA, mB), then A's value j | B's << 4
        a, b = rest[0, :bb], rest[0, bb : 2 * bb]
        scales = [a[:2], b[:2]] + ([a[2:4], b[2:4]] if head == 4 else [])
        nibbles = [torch.cat([q & 15, q >> 4]) for q in (a[head:], b[head:])]
        expected = torch.cat([*scales, nibbles[0] | (nibbles[1] << 4)])
        assert torch.equal(paired_rest[0, : 2 * bb], expected)
        if cols == 96:  # the last unpaired block as it was
            assert torch.equal(paired_rest[:, 2 * bb :], rest[:, 2 * bb :])
    # in place (what CpuBackend.install does: no second copy), over more rows than one step
    tall = quantize(torch.randn(300, cols, generator=torch.Generator().manual_seed(1)), format)
    before = tall.data.clone()
    in_place = pair_blocks(tall, in_place=True)
    assert in_place.data.data_ptr() == tall.data.data_ptr()
    assert torch.equal(in_place.data, pair_blocks(QuantWeight(format, before, 300, cols)).data)
