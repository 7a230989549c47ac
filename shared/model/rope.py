"""Rotary position embeddings with the scaling variants Llama-family checkpoints use.

``inv_freq`` follows transformers' ``modeling_rope_utils`` exactly (default, linear, dynamic NTK,
llama3), so cos/sin match the reference bit for bit in float32.

Dynamic NTK: transformers recomputes the frequencies whenever a forward pass reaches past
``max_position_embeddings``, using ``seq_len = max(position) + 1``; below that length the
frequencies are the unscaled defaults. The cos/sin cache here does the same per position: row ``p``
uses the defaults for ``p < max_position_embeddings`` and the base for ``seq_len = p + 1`` beyond,
which is what transformers computes for a one-token decode step at ``p``. (A multi-token prefill
past the limit in transformers uses one base for every token; kvmesh serves up to
``max_position_embeddings``, where the two agree exactly.)
"""

from __future__ import annotations

import math

import torch
from kvmesh.shared.model.config import ModelConfig


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def scaled_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for positions inside the trained context, (head_dim // 2,) float32."""
    inv_freq = default_inv_freq(config.head_dim, config.rope_theta)
    scaling = config.rope_scaling
    rope_type = config.rope_type
    if rope_type in ("default", "dynamic"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise AssertionError(f"unvalidated rope type {rope_type!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def dynamic_ntk_inv_freq(config: ModelConfig, seq_len: int) -> torch.Tensor:
    """transformers' dynamic NTK frequencies for a forward pass reaching ``seq_len`` tokens.

    Computed in float32 tensor arithmetic, as transformers does during decoding, to match its bits.
    """
    dim = config.head_dim
    factor = float(config.rope_scaling["factor"])
    max_pos = config.max_position_embeddings
    length = torch.tensor(max(seq_len, max_pos), dtype=torch.int64)
    base = config.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def rope_cos_sin(config: ModelConfig, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (num_positions, head_dim // 2) float32, row p for position p."""
    inv_freq = scaled_inv_freq(config)
    positions = torch.arange(num_positions, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # (P, D/2)
    if config.rope_type == "dynamic" and num_positions > config.max_position_embeddings:
        for p in range(config.max_position_embeddings, num_positions):
            freqs[p] = float(p) * dynamic_ntk_inv_freq(config, p + 1)
    return freqs.cos(), freqs.sin()


def rotation_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(P, D/2) cos/sin -> (P, D) ``cat(cos, cos)`` and ``cat(-sin, sin)``, the tables
    ``apply_rope`` takes: with them the rotation is two multiplies and an add on the whole head."""
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x: (T, H, D) by (T, 1, D) rows of ``rotation_tables`` in x's dtype; split-half
    (GPT-NeoX / HF) layout. Bit for bit transformers' ``x * cos + rotate_half(x) * sin``:
    ``rotate_half(x) * sin`` is ``roll(x) * cat(-sin, sin)`` exactly."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1), a fresh tensor
    return rotated.mul_(sin).add_(x * cos)
