"""The seeded Llama of realistic shape the GPU tests and ``make gpu-check``'s engine benchmark
share: its config (Llama-3.2-1B's shape by default), one transformers checkpoint of it written
once and reused (``$KVMESH_GPU_SEEDED_DIR``), and the kvmesh and transformers models of it."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def realistic_config(
    hidden_size: int = 2048,
    num_layers: int = 16,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    vocab_size: int = 32000,
    dtype: torch.dtype = torch.bfloat16,
) -> Any:
    """The ModelConfig of a seeded Llama; the defaults are Llama-3.2-1B's shape (hidden 2048,
    16 layers, 32 heads, 8 KV heads, intermediate 8192) with a 32k vocabulary. Token ids past the
    byte-level tokenizer's ~260 are never decoded to text here (greedy ids are compared)."""
    from kvmesh.shared.model.seeded import SeededShape

    shape = SeededShape(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=4096,
        rope_theta=500000.0,
    )
    return dataclasses.replace(shape.config(), vocab_size=vocab_size, dtype=dtype)


SEEDED_CACHE_ENV = "KVMESH_GPU_SEEDED_DIR"  # gpu_check shares one checkpoint with the tests


def seeded_checkpoint(config: Any, seed: int, root: Path) -> Path:
    """A transformers Llama checkpoint (float32 safetensors, byte-level tokenizer) of ``config``'s
    shape with ``tiny_state_dict`` weights from ``seed``, under ``root``; reused when written
    before (drawing 1.1 B parameters on the CPU takes about a minute, so gpu_check writes it once
    for its tests and its benchmark)."""
    from kvmesh.shared.model.seeded import hf_config_dict, write_hf_weights, write_tokenizer
    from kvmesh.shared.model.tiny import TINY_CHAT_TEMPLATE, TINY_SPECIALS, tiny_state_dict

    c = config
    name = f"seed{seed}-h{c.hidden_size}-l{c.num_hidden_layers}-a{c.num_attention_heads}"
    path = root / f"{name}-kv{c.num_key_value_heads}-v{c.vocab_size}"
    done = path / "done.json"
    if done.exists() and json.loads(done.read_text()) == hf_config_dict(config):
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_hf_weights(path, config, tiny_state_dict(config, seed=seed))
    write_tokenizer(path, TINY_SPECIALS, "<|bos|>", "<|end|>", TINY_CHAT_TEMPLATE)
    done.write_text(json.dumps(hf_config_dict(config)))
    return path


def seeded_models(
    config: Any, seed: int, device: str | torch.device, root: Path | None = None
) -> tuple[Any, Any]:
    """(kvmesh model, transformers model) of the same seeded weights, both in ``config.dtype`` on
    ``device``, loaded from ``seeded_checkpoint`` under ``root`` (default: $KVMESH_GPU_SEEDED_DIR,
    else a temporary folder). transformers uses its default (SDPA) attention."""
    from kvmesh.shared.model.loader import load_model
    from transformers import AutoModelForCausalLM

    with contextlib.ExitStack() as stack:
        if root is None:
            cached = os.environ.get(SEEDED_CACHE_ENV)
            root = (
                Path(cached) if cached else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            )
        path = seeded_checkpoint(config, seed, root)
        model, _ = load_model(str(path), config.torch_dtype, device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=config.torch_dtype).to(device)
    return model, hf.eval()
