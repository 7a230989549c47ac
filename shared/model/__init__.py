"""Llama-family models: config, rotary embeddings, the decoder, checkpoint loading, kvmesh-tiny.

The names below are imported on first use, so that the torch-free modules (``config``,
``checkpoint_info``, ``tiny``'s config and tokenizer) can be imported without torch: the router
reads a model's config and tokenizer and never computes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvmesh.shared.model.checkpoint_info import ModelLoadError, load_config_and_tokenizer
    from kvmesh.shared.model.config import ModelConfig, ModelConfigError
    from kvmesh.shared.model.llama import Transformer, kv_cache_spec
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.model.tiny import TINY_NAME

_HOMES = {
    "TINY_NAME": "tiny",
    "ModelConfig": "config",
    "ModelConfigError": "config",
    "ModelLoadError": "checkpoint_info",
    "Transformer": "llama",
    "kv_cache_spec": "llama",
    "load_config_and_tokenizer": "checkpoint_info",
    "load_model": "loader",
}

__all__ = [
    "TINY_NAME",
    "ModelConfig",
    "ModelConfigError",
    "ModelLoadError",
    "Transformer",
    "kv_cache_spec",
    "load_config_and_tokenizer",
    "load_model",
]
assert set(__all__) == set(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
