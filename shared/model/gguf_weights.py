"""A Llama GGUF's tensors as Hugging Face ``LlamaForCausalLM`` tensors, dequantized, or (with
``keep_formats``) as stored where kvmesh computes with the format.

llama.cpp names tensors ``blk.N.attn_q.weight`` where transformers says
``model.layers.N.self_attn.q_proj.weight``, stores every type ``gguf.quants`` knows (F32, F16,
BF16, Q4_0 ... Q8_0, the K-quants, the IQ types), and its converter permutes the rows of Llama's
Q and K projections: HF's rotary embedding rotates the two halves of each head, llama.cpp's
rotates adjacent pairs, so the converter interleaves the halves; :func:`unpermute_rows` undoes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from kvmesh.shared.model.gguf_file import GGUFError, GGUFFile, GGUFTensor
from kvmesh.shared.model.quant_formats import STORED_FORMATS, cols_multiple, row_bytes

# GGUF tensor name -> HF name ({i}: the layer); names outside this table are refused.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, None when kvmesh's Llama has no such tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: (num_heads * head_dim, ...) rows, per head
    interleaved (r0, r_half, r1, r_half+1, ...) back to halves (r0, r1, ..., r_half, ...)."""
    rows = weight.shape[0]
    assert rows % (2 * num_heads) == 0, (rows, num_heads)
    half = rows // num_heads // 2
    # converter: reshape(heads, 2, half, ...).swapaxes(1, 2); the inverse swaps back
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def dequantize(tensor: GGUFTensor, path: object) -> np.ndarray:
    """The tensor as float32 in its logical shape."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        values = gguf_dequantize(tensor.raw, tensor.qtype)
    except NotImplementedError:
        raise GGUFError(
            f"{path}: tensor {tensor.name!r} has type {tensor.type_name}, which the gguf package "
            "cannot dequantize; requantize the model to a supported type (e.g. Q8_0, Q4_K_M, F16)"
        ) from None
    values = np.asarray(values, dtype=np.float32)
    if values.size != int(np.prod(tensor.shape)):
        raise GGUFError(
            f"{path}: tensor {tensor.name!r} ({tensor.type_name}) dequantizes to {values.size} "
            f"values, its shape {tensor.shape} says {int(np.prod(tensor.shape))}"
        )
    return values.reshape(tensor.shape)


def check_tensor_names(gguf: GGUFFile) -> None:
    """Refuse tensors this importer would drop: a model with them computes something else."""
    unknown = sorted(n for n in gguf.tensors if hf_name(n) is None)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:4])
        more = f" (and {len(unknown) - 4} more)" if len(unknown) > 4 else ""
        raise GGUFError(
            f"{gguf.path}: tensors {shown}{more} have no place in a Llama decoder; this is "
            "not a plain Llama-architecture model"
        )


def is_storable(tensor: GGUFTensor) -> bool:
    """Whether kvmesh computes with ``tensor`` as stored: a matrix in one of ``STORED_FORMATS``
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K-quants, F16, BF16) whose rows hold whole blocks of
    32 values (the kernels quantize the activations per 32)."""
    return (
        tensor.type_name in STORED_FORMATS
        and len(tensor.shape) == 2
        and tensor.shape[1] % cols_multiple(tensor.type_name) == 0
    )


def stored(tensor: GGUFTensor) -> np.ndarray:
    """A tensor kvmesh computes with as stored (``is_storable``): its raw blocks (or 2-byte
    floats) as a (rows, row bytes) uint8 array, a copy."""
    assert is_storable(tensor), (tensor.name, tensor.type_name, tensor.shape)
    rows, cols = tensor.shape
    raw = np.ascontiguousarray(tensor.raw).view(np.uint8)  # F16: float16 items, as bytes
    return raw.reshape(rows, row_bytes(tensor.type_name, cols)).copy()


def hf_tensors(
    gguf: GGUFFile, num_heads: int, num_kv_heads: int, keep_formats: bool = False
) -> Iterator[tuple[str, np.ndarray, str | None]]:
    """(HF name, array, format) for every tensor, Q and K rows unpermuted: float32 values and
    None, or with ``keep_formats`` a storable tensor's bytes (``stored``) and its format
    (blocks lie along rows, so rows permute as bytes)."""
    check_tensor_names(gguf)
    for name, tensor in gguf.tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        is_kept = keep_formats and is_storable(tensor)
        values = stored(tensor) if is_kept else dequantize(tensor, gguf.path)
        if name.endswith(".attn_q.weight"):
            values = unpermute_rows(values, num_heads)
        elif name.endswith(".attn_k.weight"):
            values = unpermute_rows(values, num_kv_heads)
        yield target, values, tensor.type_name if is_kept else None
