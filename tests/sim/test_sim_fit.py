"""Calibration's fit: it recovers known figures from synthetic points and refuses nonsense."""

from __future__ import annotations

import dataclasses

import pytest
from kvmesh.sim.calibrate import last_level_cache_bytes, parse_size
from kvmesh.sim.cost import CostModel, Slice
from kvmesh.sim.fit import DecodePoint, FitError, PrefillPoint, fit_costs
from kvmesh.sim.specs import DeviceSpec, load_model

TINY = load_model("kvmesh-tiny")  # 13 MB of float32 weights
SHAPES = [(b, c) for b in (1, 4, 16) for c in (72, 520)]
LENGTHS = (128, 512, 1024)


def _points(device: DeviceSpec, model=TINY):
    cost = CostModel(model, device)
    decode = [DecodePoint(b, c, cost.step_seconds([Slice(1, c)] * b)) for b, c in SHAPES]
    prefill = [PrefillPoint(n, cost.step_seconds([Slice(n, 0)])) for n in LENGTHS]
    return decode, prefill


def _cpu(cache_bytes: float, seq_overhead_s: float = 1e-4) -> DeviceSpec:
    return DeviceSpec(
        "true",
        peak_flops=20e9,
        mem_bandwidth=1e9,
        memory_bytes=1e9,
        link_bandwidth=1e9,
        step_overhead_s=2e-3,
        seq_overhead_s=seq_overhead_s,
        chunk_overhead_s=1e-3,
        cache_bytes=cache_bytes,
    )


@pytest.mark.parametrize("cache_bytes", [32 << 20, 0], ids=["weights-cached", "weights-streamed"])
def test_fit_recovers_known_figures_from_exact_points(cache_bytes):
    true = _cpu(cache_bytes)
    fit = fit_costs(TINY, cache_bytes, *_points(true))
    assert fit.flops == pytest.approx(20e9, rel=1e-6)
    assert fit.bandwidth == pytest.approx(1e9, rel=1e-3)
    assert fit.step_overhead_s == pytest.approx(2e-3, rel=1e-2)
    assert fit.seq_overhead_s == pytest.approx(1e-4, rel=1e-2)
    assert fit.chunk_overhead_s == pytest.approx(1e-3, rel=1e-2)
    assert fit.max_relative_error < 1e-3
    assert not fit.notes


def test_fit_counts_a_later_chunks_attention_over_its_cached_context():
    true = _cpu(32 << 20)
    cost = CostModel(TINY, true)
    decode, prefill = _points(true)
    chunks = [PrefillPoint(512, cost.step_seconds([Slice(512, c)]), context=c) for c in (512, 1024)]
    fit = fit_costs(TINY, 32 << 20, decode, prefill + chunks)
    assert fit.flops == pytest.approx(20e9, rel=1e-6)  # exact only if the context's pairs count
    assert fit.max_relative_error < 1e-3  # the bandwidth grid's resolution
    assert "prefill 512 after 1024" in [r.label for r in fit.residuals]


def test_fit_recovers_figures_within_the_noise_of_noisy_points():
    decode, prefill = _points(_cpu(32 << 20))
    wobble = [1.04, 0.97, 1.02, 0.96, 1.03, 0.98]  # a few percent, as a quiet machine gives
    decode = [
        DecodePoint(p.batch, p.context, p.seconds * w) for p, w in zip(decode, wobble, strict=True)
    ]
    fit = fit_costs(TINY, 32 << 20, decode, prefill)
    assert fit.step_overhead_s == pytest.approx(2e-3, rel=0.15)
    assert fit.bandwidth == pytest.approx(1e9, rel=0.3)
    assert fit.max_relative_error < 0.06


def test_fit_leaves_out_a_per_sequence_cost_the_data_do_not_show():
    fit = fit_costs(TINY, 32 << 20, *_points(_cpu(32 << 20, seq_overhead_s=0.0)))
    assert fit.seq_overhead_s == pytest.approx(0.0, abs=1e-6)
    assert fit.step_overhead_s == pytest.approx(2e-3, rel=1e-2)


def test_fit_refuses_zero_overhead_when_batch_one_steps_take_time():
    # steps grow 10 ms a sequence from a 5 ms batch-1 step: the line's intercept is -5 ms
    decode = [DecodePoint(b, c, -5e-3 + 10e-3 * b) for b, c in SHAPES]
    _, prefill = _points(_cpu(32 << 20))
    with pytest.raises(FitError, match=r"per-step overhead .* not writing"):
        fit_costs(TINY, 32 << 20, decode, prefill)


def test_fit_refuses_prefill_that_does_not_grow_with_length():
    decode, _ = _points(_cpu(32 << 20))
    prefill = [PrefillPoint(128, 0.3), PrefillPoint(512, 0.2), PrefillPoint(1024, 0.1)]
    with pytest.raises(FitError, match="does not grow with prompt length"):
        fit_costs(TINY, 32 << 20, decode, prefill)


def test_fit_refuses_too_few_points():
    decode, prefill = _points(_cpu(32 << 20))
    with pytest.raises(FitError, match="two lengths"):
        fit_costs(TINY, 0, decode, prefill[:1])


def test_cache_size_is_read_from_sysfs_largest_data_or_unified_level(tmp_path):
    for i, (kind, size) in enumerate(
        [("Data", "32K"), ("Instruction", "64M"), ("Unified", "32768K")]
    ):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "type").write_text(kind + "\n")
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    assert last_level_cache_bytes(tmp_path) == 32 << 20


def test_lscpu_sizes_parse_with_their_units():
    assert parse_size(" 32 MiB (1 instance)") == 32 << 20
    assert parse_size("512K") == 512 << 10
    assert parse_size("n/a") is None


def test_fit_refuses_points_it_misses_by_more_than_half():
    # the loaded box's run: batch-1 steps 100x slower than batch 4 (neighbours, not the engine)
    decode, prefill = _points(_cpu(32 << 20))
    decode = [
        DecodePoint(p.batch, p.context, p.seconds * (100 if p.batch == 1 else 1)) for p in decode
    ]
    with pytest.raises(FitError, match=r"misses decode batch 1 .* not writing"):
        fit_costs(TINY, 32 << 20, decode, prefill)


def test_fit_recovers_an_attention_phase_of_its_own():
    # a CPU engine: attention at a fifth of the matmuls' FLOP/s, its KV read at 2 GB/s beside
    # weights streamed at 40: one roofline over both cannot describe it (the 23M model's points)
    true = dataclasses.replace(
        _cpu(0), mem_bandwidth=40e9, attention_flops=4e9, attention_bandwidth=2e9
    )
    cost = CostModel(TINY, true)
    decode, prefill = _points(true)
    chunks = [PrefillPoint(512, cost.step_seconds([Slice(512, c)]), context=c) for c in (512, 1024)]
    fit = fit_costs(TINY, 0, decode, prefill + chunks)
    assert fit.attention_flops == pytest.approx(4e9, rel=1e-3)
    assert fit.flops == pytest.approx(20e9, rel=1e-3)
    assert fit.attention_bandwidth == pytest.approx(2e9, rel=0.02)
    assert fit.max_relative_error < 0.01
    one_roofline = CostModel(
        TINY, dataclasses.replace(true, attention_flops=0, attention_bandwidth=0)
    )
    long = [Slice(1, 520)] * 16  # the split costs the KV read on top of the matmuls
    assert cost.step_seconds(long) > one_roofline.step_seconds(long) * 1.3


def test_a_device_with_attention_flops_needs_its_bandwidth_too():
    with pytest.raises(ValueError, match="attention_flops, attention_bandwidth"):
        dataclasses.replace(_cpu(0), attention_flops=1e9)
