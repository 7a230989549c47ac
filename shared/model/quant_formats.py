"""The GGUF formats kvmesh keeps weights in, as plain facts (no torch): values and bytes per
block, the checkpoint's metadata key and the C kernels' format codes. ``quant.py`` holds the
torch definitions of the formats; the importer and the CLI read only this module."""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 32  # values per block of the 32-value formats (QUANT_FORMATS)
# format -> bytes per block
BLOCK_BYTES = {
    "Q8_0": 34,
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q4_K": 144,
    "Q5_K": 176,
    "Q6_K": 210,
    "F16": 2,
    "BF16": 2,
}
# format -> values per block: 32, the K-quants' super-blocks of 256, one for a float
BLOCK_VALUES = {
    "Q8_0": 32,
    "Q4_0": 32,
    "Q4_1": 32,
    "Q5_0": 32,
    "Q5_1": 32,
    "Q4_K": 256,
    "Q5_K": 256,
    "Q6_K": 256,
    "F16": 1,
    "BF16": 1,
}
# blocks of 32 values (quant.quantize writes them)
QUANT_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_FORMATS = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256 values
FLOAT_FORMATS = ("F16", "BF16")  # 2-byte floats: the kernels multiply them by float32 inputs
STORED_FORMATS = QUANT_FORMATS + K_FORMATS + FLOAT_FORMATS  # every format kept as stored
# safetensors metadata key of a checkpoint holding weights as stored: a JSON object, tensor name
# -> format; each such tensor is its (rows, row bytes) uint8 blocks
CHECKPOINT_KEY = "kvmesh.quant_formats"
# format codes the C kernels take (kernels/cpu_quant.c: KV_Q8_0 ... KV_BF16)
FORMAT_CODES = {
    "Q8_0": 0,
    "Q4_0": 1,
    "Q4_1": 2,
    "Q4_K": 3,
    "Q5_K": 4,
    "Q6_K": 5,
    "F16": 6,
    "BF16": 7,
    "Q5_0": 8,
    "Q5_1": 9,
}
# or-ed into a Q4, Q5 or Q8_0 format code: the weight is in the kernels' paired layout
# (quant.pair_blocks: rows interleaved in groups of 16)
PAIRED_FLAG = 16
# the code of a weight whose rows are parts in several formats (quant.StackedWeight: q, k and v
# of a Q4_K_M file, Q4_K beside Q6_K); its data is the kernels' kv_wstack descriptor
STACKED_CODE = 32
MAX_STACKED_PARTS = 4


def cols_multiple(format: str) -> int:
    """What a row's length must be a multiple of in ``format``: whole blocks, and whole blocks of
    32 for the activations' per-block quantization (kernels/cpu_quant.c)."""
    return max(BLOCK_VALUES[format], BLOCK)


def row_bytes(format: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``format``."""
    return cols // BLOCK_VALUES[format] * BLOCK_BYTES[format]


def row_values(format: str, nbytes: int) -> int:
    """Values of one row of ``nbytes`` bytes in ``format`` (the inverse of ``row_bytes``)."""
    return nbytes // BLOCK_BYTES[format] * BLOCK_VALUES[format]


def checkpoint_keeps_stored(directory: str | Path) -> bool:
    """Whether the checkpoint folder ``directory`` keeps weights as stored: one of its
    ``*.safetensors`` files names a tensor under ``CHECKPOINT_KEY`` in its metadata (only the
    files' JSON headers are read). What "auto" KV resolves by where there is no model to look
    at: the KV store's blocks (``EngineConfig.kv_dtype``)."""
    return any(_stored_tensors(path) for path in sorted(Path(directory).glob("*.safetensors")))


def _stored_tensors(path: Path) -> dict[str, str]:
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        formats = json.loads((header.get("__metadata__") or {}).get(CHECKPOINT_KEY) or "{}")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a readable safetensors header: {e}") from None
    if not isinstance(formats, dict):
        raise ValueError(f"{path}: metadata {CHECKPOINT_KEY!r} is not a name -> format object")
    return formats
