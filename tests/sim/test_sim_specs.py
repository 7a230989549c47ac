"""Device and model spec files: every built-in one loads; bad ones are refused by name."""

from __future__ import annotations

import json

import pytest
from kvmesh.sim.specs import (
    DeviceSpec,
    SpecError,
    builtin_names,
    load_device,
    load_model,
    write_device,
)


def test_builtin_specs_cover_the_issue_hardware_and_models():
    assert {"h100", "h200", "a100", "cpu"} <= set(builtin_names("devices"))
    assert {"llama-3-8b", "llama-3-70b", "seeded-23m", "kvmesh-tiny"} <= set(
        builtin_names("models")
    )
    for name in builtin_names("devices"):
        assert load_device(name).effective_flops > 0
    for name in builtin_names("models"):
        assert load_model(name).kv_bytes_per_token > 0


def test_seeded_spec_matches_kvmesh_model_seeded_default_shape():
    from kvmesh.shared.model.seeded import SeededShape

    config = SeededShape().config()
    spec = load_model("seeded-23m")
    assert (spec.hidden_size, spec.intermediate_size, spec.num_layers) == (
        config.hidden_size,
        config.intermediate_size,
        config.num_hidden_layers,
    )
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
        config.vocab_size,
    )


def test_unknown_spec_name_lists_the_builtin_ones():
    with pytest.raises(SpecError, match="h100"):
        load_device("b200-imaginary")


def test_spec_with_unknown_field_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "name": "x",
                "peak_flops": 1,
                "mem_bandwidth": 1,
                "memory_bytes": 1,
                "link_bandwidth": 1,
                "tflops": 3,
            }
        )
    )
    with pytest.raises(SpecError, match="tflops"):
        load_device(path)


def test_written_device_spec_loads_back(tmp_path):
    spec = DeviceSpec("cal", 2e10, 1e10, 8e9, 5e9, step_overhead_s=0.002, description="test")
    assert load_device(write_device(spec, tmp_path / "cal.json")) == spec
