"""Llama-family models: config, rotary embeddings, the decoder, checkpoint loading, kvmesh-tiny."""

from kvmesh.shared.model.config import ModelConfig, ModelConfigError
from kvmesh.shared.model.llama import Transformer, kv_cache_spec
from kvmesh.shared.model.loader import ModelLoadError, load_config_and_tokenizer, load_model
from kvmesh.shared.model.tiny import TINY_NAME

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
