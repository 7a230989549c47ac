"""The roofline cost model against FLOPs and bytes counted by hand for a small shape."""

from __future__ import annotations

import pytest
from kvmesh.sim.cost import CostModel, Slice
from kvmesh.sim.specs import DeviceSpec, ModelSpec, load_device, load_model

# hidden 8, MLP 16, 2 layers, 2 heads / 1 KV head of 4, vocab 10, 2-byte weights and KV
SMALL = ModelSpec("small", 8, 16, 2, 2, 1, 4, 10, 2)
SLOW = DeviceSpec(
    "slow", peak_flops=1000.0, mem_bandwidth=1000.0, memory_bytes=1e6, link_bandwidth=100.0
)


def test_model_shape_counts_match_hand_arithmetic():
    # q/k/v/o: 8*(8+4+4) + 8*8 = 192; MLP 3*8*16 = 384
    assert SMALL.layer_params == 576
    assert SMALL.weight_bytes == (2 * 576 + 2 * 80) * 2
    assert SMALL.kv_bytes_per_token == 2 * 2 * 4 * 2  # K and V, 2 layers, 1 head of 4, 2 bytes


def test_prefill_chunk_flops_and_bytes_match_hand_count():
    cost = CostModel(SMALL, SLOW)
    chunk = Slice(num_new=3, context=5)
    # matmuls 2*2*576*3 = 6912; attention pairs 3*5 + (1+2+3) = 21 -> 4*2 layers*2 heads*4*21 = 1344;
    # LM head on the last token 2*80 = 160
    assert cost.step_flops([chunk]) == 6912 + 1344 + 160
    # weights 2624 + KV of 5 cached + 3 new tokens at 32 bytes
    assert cost.step_bytes([chunk]) == 2624 + 8 * 32
    # compute-bound here: 8416 FLOPs at 1000 FLOP/s
    assert cost.step_seconds([chunk]) == pytest.approx(8.416)


def test_decode_step_sums_its_sequences_and_reads_weights_once():
    cost = CostModel(SMALL, SLOW)
    one = Slice(1, 7)
    assert cost.step_flops([one]) == 2 * 2 * 576 + 4 * 2 * 2 * 4 * 8 + 160
    assert cost.step_bytes([one, one]) == 2624 + 2 * 8 * 32


def test_memory_bound_step_is_charged_bandwidth_and_overhead():
    device = DeviceSpec("d", 1e12, 1000.0, 1e6, 100.0, step_overhead_s=0.5)
    cost = CostModel(SMALL, device)
    assert cost.step_seconds([Slice(1, 7)]) == pytest.approx(0.5 + 2880 / 1000)


def test_tensor_parallel_multiplies_compute_and_bandwidth():
    one, two = CostModel(SMALL, SLOW), CostModel(SMALL, SLOW, tp=2)
    chunk = [Slice(3, 5)]
    assert two.step_seconds(chunk) == pytest.approx(one.step_seconds(chunk) / 2)


def test_transfer_takes_kv_bytes_over_link_plus_latency():
    device = DeviceSpec("d", 1.0, 1.0, 1e6, link_bandwidth=64.0, link_latency_s=0.25)
    assert CostModel(SMALL, device).transfer_seconds(10) == pytest.approx(0.25 + 320 / 64)


def test_llama_3_8b_kv_is_128_kib_per_token():
    llama = load_model("llama-3-8b")
    assert llama.kv_bytes_per_token == 131072  # 32 layers x 8 KV heads x 128 x K,V x bf16
    assert 15.5e9 < llama.weight_bytes < 16.5e9


def test_kv_capacity_refuses_a_model_that_does_not_fit():
    small_gpu = DeviceSpec("tiny", 1e12, 1e12, memory_bytes=1e9, link_bandwidth=1e9)
    with pytest.raises(ValueError, match="does not fit"):
        CostModel(load_model("llama-3-8b"), small_gpu).kv_capacity_tokens()


# hidden 8, the same attention and KV as SMALL, but a 4x wider MLP: more weight bytes, same KV
WIDE = ModelSpec("wide", 8, 64, 2, 2, 1, 4, 10, 2)
FAST_COMPUTE = dict(peak_flops=1e30, mem_bandwidth=1000.0, memory_bytes=1e9, link_bandwidth=1.0)


def test_weights_in_cache_leave_decode_time_independent_of_weight_bytes():
    cached = DeviceSpec("cached", **FAST_COMPUTE, cache_bytes=1e6, step_overhead_s=0.5)
    step = [Slice(1, 7)] * 2
    small, wide = CostModel(SMALL, cached), CostModel(WIDE, cached)
    assert WIDE.weight_bytes > SMALL.weight_bytes
    assert small.weights_resident and wide.weights_resident
    # only the KV moves: 2 sequences x 8 tokens x 32 bytes
    assert small.step_seconds(step) == pytest.approx(0.5 + 512 / 1000)
    assert wide.step_seconds(step) == small.step_seconds(step)


def test_weights_out_of_cache_are_streamed_every_step():
    uncached = DeviceSpec("small-cache", **FAST_COMPUTE, cache_bytes=SMALL.weight_bytes - 1)
    step = [Slice(1, 7)] * 2
    cost = CostModel(SMALL, uncached)
    assert not cost.weights_resident
    assert cost.step_seconds(step) == pytest.approx((2624 + 512) / 1000)
    wide = CostModel(WIDE, uncached).step_seconds(step)
    assert wide == pytest.approx((WIDE.weight_bytes + 512) / 1000)


def test_tensor_parallel_splits_weights_across_the_caches():
    cache = SMALL.weight_bytes / 2
    device = DeviceSpec("half", **FAST_COMPUTE, cache_bytes=cache)
    assert not CostModel(SMALL, device).weights_resident
    assert CostModel(SMALL, device, tp=2).weights_resident


def test_overheads_are_paid_per_step_per_sequence_and_per_prefill_chunk():
    device = DeviceSpec(
        "fixed",
        1e30,
        1e30,
        1e9,
        1.0,
        step_overhead_s=1.0,
        seq_overhead_s=0.1,
        chunk_overhead_s=0.01,
    )
    cost = CostModel(SMALL, device)
    step = cost.step([Slice(1, 5), Slice(1, 9), Slice(3, 0)])
    assert step.overhead_s == pytest.approx(1.0 + 3 * 0.1 + 0.01)
    assert step.seconds == pytest.approx(step.overhead_s + step.roofline_s)


def test_h100_still_streams_llama_3_8b_weights_every_decode_step():
    cost = CostModel(load_model("llama-3-8b"), load_device("h100"))
    assert cost.device.cache_bytes == 50e6 and not cost.weights_resident
    memory_s = cost.step_bytes([Slice(1, 1000)]) / cost.device.effective_bandwidth
    assert memory_s > 6e-3  # 16 GB at 2.5 TB/s
    assert cost.step_seconds([Slice(1, 1000)]) == pytest.approx(1e-3 + memory_s)
