"""A seeded Llama checkpoint small enough for end-to-end tests (another model than kvmesh-tiny:
another shape, so another model_spec and other greedy outputs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.shared.model.seeded import SeededShape


def small_shape() -> SeededShape:
    """Its shape: hidden 64, 2 layers, 2 query heads sharing 1 KV head, a 1024-token context."""
    from kvmesh.shared.model.seeded import SeededShape

    return SeededShape(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=1024,
    )


def write_small_seeded(path: Path, seed: int = 5) -> str:
    """Write it into ``path`` (its base name becomes the default mesh name); returns the path."""
    from kvmesh.shared.model.seeded import write_seeded_checkpoint

    write_seeded_checkpoint(path, small_shape(), seed=seed)
    return str(path)
