"""ModelConfig: the parts of a Hugging Face ``config.json`` a Llama-family decoder needs.

Torch-free (the router reads configs and never computes): the weights' dtype is kept by name
(``ModelConfig.dtype``, e.g. "bfloat16"); ``torch_dtype`` and ``parse_dtype`` import torch.

Accepts both the classic ``rope_theta`` / ``rope_scaling`` keys and transformers v5's
``rope_parameters`` dict. Anything the model would silently compute differently from the
reference (an active sliding window, an unknown activation or RoPE type) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmesh.shared.config.json_object import json_object

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")  # torch's names
# Checkpoints name dtypes loosely; these are the spellings seen in the wild.
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}


class ModelConfigError(ValueError):
    """A config.json (or a config built in code) that kvmesh cannot serve as written."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A validated Llama-family decoder configuration."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # Normalised rope scaling, e.g. {"rope_type": "llama3", "factor": 8.0, ...}; None means default.
    rope_scaling: Mapping[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    attention_out_bias: bool = (
        False  # bias on o_proj (Llama's attention_bias covers it, Qwen2's doesn't)
    )
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # the weights' dtype, by name; given a torch.dtype, its name is kept
    source: str = "<in code>"  # where the config came from, for error messages
    # The whole parsed config.json, for fields kvmesh does not model.
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        where = self.source
        object.__setattr__(self, "dtype", dtype_name(self.dtype, where))
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"{where}: architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ModelConfigError(f"{where}: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelConfigError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelConfigError(
                f"{where}: head_dim must be even for rotary embeddings, got {self.head_dim}"
            )
        if not self.rms_norm_eps > 0:
            raise ModelConfigError(
                f"{where}: rms_norm_eps must be positive, got {self.rms_norm_eps!r}"
            )
        if not self.rope_theta > 0:
            raise ModelConfigError(f"{where}: rope_theta must be positive, got {self.rope_theta!r}")
        for token_id in (self.bos_token_id, *self.eos_token_ids):
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ModelConfigError(
                    f"{where}: special token id {token_id} is outside the vocabulary (size {self.vocab_size})"
                )
        _validate_rope_scaling(self.rope_scaling, where)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype as a torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else str(self.rope_scaling["rope_type"])

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json; ``source`` names the file in error messages."""
        return _from_hf_dict(raw, source)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read and validate ``path`` (a config.json)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ModelConfigError(
                f"{path}: file not found (a HF checkpoint needs config.json)"
            ) from None
        return _from_hf_dict(json_object(text, str(path), ModelConfigError), str(path))


def dtype_name(value: object, source: str) -> str:
    """A checkpoint's or a caller's dtype spelling ("bfloat16", "torch.float16", "bf16", a
    torch.dtype, ...) as torch's name of it. Torch-free."""
    name = str(value).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in SUPPORTED_DTYPES:
        raise ModelConfigError(
            f"{source}: dtype {value!r} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        )
    return name


def parse_dtype(
    value: str | torch.dtype | None, source: str, default: torch.dtype | None = None
) -> torch.dtype:
    """Map a dtype spelling (as ``dtype_name`` takes it) to a torch dtype; ``default`` (float32
    unless given) for None."""
    import torch

    if value is None:
        return torch.float32 if default is None else default
    return getattr(torch, dtype_name(value, source))


def _validate_rope_scaling(scaling: Mapping[str, Any] | None, where: str) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{where}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required = {
        "default": (),
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
    }[rope_type]
    for key in required:
        if key not in scaling:
            raise ModelConfigError(
                f"{where}: rope scaling {rope_type!r} needs {key!r}, got {dict(scaling)}"
            )
    if rope_type != "default" and not float(scaling["factor"]) > 0:
        raise ModelConfigError(
            f"{where}: rope scaling factor must be positive, got {scaling['factor']!r}"
        )
    if rope_type == "llama3" and not float(scaling["high_freq_factor"]) > float(
        scaling["low_freq_factor"]
    ):
        raise ModelConfigError(
            f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor"
        )


def _from_hf_dict(raw: Mapping[str, Any], source: str) -> ModelConfig:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not architectures:
        raise ModelConfigError(
            f"{source}: no 'architectures' entry; expected one of {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    arch = architectures[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelConfigError(
            f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ModelConfigError(f"{source}: missing required key {key!r}")
        return raw[key]

    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelConfigError(
            f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')"
        )
    hidden_size = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden_size // num_heads
    max_pos = int(raw.get("max_position_embeddings", 4096))
    num_layers = int(need("num_hidden_layers"))
    _refuse_active_sliding_window(raw, arch, num_layers, max_pos, source)
    rope_theta, rope_scaling = _parse_rope(raw, max_pos, source)

    is_qwen2 = arch == "Qwen2ForCausalLM"
    llama_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(need("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if is_qwen2 else llama_bias,
        attention_out_bias=False if is_qwen2 else llama_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=_checkpoint_dtype(raw, source),
        source=source,
        extra=dict(raw),
    )


def _checkpoint_dtype(raw: Mapping[str, Any], source: str) -> str:
    """config.json's ``dtype`` (transformers v5) or ``torch_dtype`` (v4); float32 without."""
    value = raw.get("dtype", raw.get("torch_dtype"))
    return "float32" if value is None else dtype_name(value, source)


def _parse_rope(
    raw: Mapping[str, Any], max_pos: int, source: str
) -> tuple[float, dict[str, Any] | None]:
    """Merge ``rope_theta``/``rope_scaling`` (v4) and ``rope_parameters`` (v5) into (theta, scaling)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    theta = float(merged.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", "default")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelConfigError(f"{source}: partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    merged["rope_type"] = rope_type
    if rope_type == "llama3":
        merged.setdefault("original_max_position_embeddings", max_pos)
    return theta, merged


def _refuse_active_sliding_window(
    raw: Mapping[str, Any], arch: str, num_layers: int, max_pos: int, source: str
) -> None:
    window = raw.get("sliding_window")
    if window is None or int(window) >= max_pos:
        return
    if arch == "MistralForCausalLM":
        active = True
    elif arch == "Qwen2ForCausalLM":
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            active = "sliding_attention" in layer_types
        else:
            max_window_layers = int(raw.get("max_window_layers", num_layers))
            active = bool(raw.get("use_sliding_window", False)) and max_window_layers < num_layers
    else:
        active = False
    if active:
        raise ModelConfigError(
            f"{source}: sliding-window attention (sliding_window={window}, shorter than "
            f"max_position_embeddings={max_pos}) is not supported; kvmesh attends over the full context "
            "and would compute different outputs. Set sliding_window to null (or use_sliding_window to "
            "false) if the model was trained without it."
        )
