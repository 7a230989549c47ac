"""What two services compare to know they serve the same model (torch-free, pure).

``model_spec``: the router and the decode workers (the ``model_spec`` field of their messages);
``kv_spec_fingerprint``: prefill, decode, draft workers and kv-stores, who exchange KV blocks only
when these strings are equal (the ``kv_spec`` fields)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any


def model_spec(model_config: Any) -> str:
    """What a router and a decode worker must agree on to serve one model: its KV layout per
    token (layers, KV heads, head size) and a digest of its architecture, vocabulary and special
    tokens. Independent of the weights' dtype, the block size and where the checkpoint lies, so
    the router (which reads only config.json) computes the same string as the decode workers."""
    fields = {
        f.name: getattr(model_config, f.name)
        for f in dataclasses.fields(model_config)
        if f.name not in _NOT_MODEL_IDENTITY
    }
    digest = hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=4).hexdigest()
    mc = model_config
    layout = f"L{mc.num_hidden_layers}-H{mc.num_key_value_heads}-D{mc.head_dim}"
    return f"{layout}:model-{digest}"


# ModelConfig fields that say how a model is stored or loaded, not which model it is
_NOT_MODEL_IDENTITY = frozenset({"dtype", "source", "extra"})


def kv_spec_fingerprint(spec: Any, model_config: Any) -> str:
    """``DecodeAdvert.kv_spec``: the KV layout (``KVCacheSpec.fingerprint()``) plus a digest of
    the model config. Prefill and decode exchange blocks only when these strings are equal."""
    digest = hashlib.blake2b(repr(model_config).encode(), digest_size=4).hexdigest()
    return f"{spec.fingerprint()}:model-{digest}"
