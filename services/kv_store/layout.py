"""The store's block layout: the mesh's KV layout and fingerprint, from config.json (and the
safetensors headers, for whether "auto" KV is float16: weights kept as stored).

A decode worker's engine builds ``KVCacheSpec(layers, KV heads, head size, block size, dtype)``
from its loaded model and names it ``kv_spec_fingerprint(spec, model.config)``; the store does the
same from the config the loader reads before any weights (``load_config_and_tokenizer``, which
``load_model`` itself starts from), so the two strings are equal for the same --model, --dtype and
--block-size, and a store never needs the weights.
"""

from __future__ import annotations

from pathlib import Path

from kvmesh.shared.engine.config import EngineConfig
from kvmesh.shared.kv.kv_cache import KVCacheSpec
from kvmesh.shared.model.config import parse_dtype
from kvmesh.shared.model.identity import kv_spec_fingerprint
from kvmesh.shared.model.loader import TINY_NAME, load_config_and_tokenizer
from kvmesh.shared.model.quant_formats import checkpoint_keeps_stored


def store_layout(
    model: str, dtype: str | None, block_size: int, kv_cache_dtype: str = "auto"
) -> tuple[KVCacheSpec, str]:
    """``(spec, kv_spec)`` of the blocks a store of ``model`` holds (``kv_cache_dtype``: the
    workers' ``--kv-cache-dtype``, e.g. int8 or fp8_e4m3 blocks with their scales)."""
    torch_dtype = parse_dtype(dtype, "--dtype") if dtype is not None else None
    name = model if model == TINY_NAME else str(Path(model))  # as load_model names it
    config, _ = load_config_and_tokenizer(name, torch_dtype)
    spec = KVCacheSpec(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        block_size,
        EngineConfig(kv_cache_dtype=kv_cache_dtype).kv_dtype(
            config.torch_dtype, model != TINY_NAME and checkpoint_keeps_stored(name)
        ),
    )
    return spec, kv_spec_fingerprint(spec, config)
