"""The GGUF block formats kvmesh keeps weights in, as plain facts (no torch): block size, bytes
per block, the checkpoint's metadata key and the C kernels' format codes. ``quant.py`` holds the
torch definitions of the formats; the importer and the CLI read only this module."""

from __future__ import annotations

BLOCK = 32  # values per block, every format here
# format -> bytes per block
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
QUANT_FORMATS = tuple(BLOCK_BYTES)
# safetensors metadata key of a checkpoint holding weights as stored: a JSON object, tensor name
# -> format; each such tensor is its (rows, row bytes) uint8 blocks
CHECKPOINT_KEY = "kvmesh.quant_formats"
# format codes the C kernels take (kernels/cpu_quant.c: KV_Q8_0, KV_Q4_0, KV_Q4_1)
FORMAT_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2}
# or-ed into a Q4 format code: the weight is in the kernels' paired layout (quant.pair_blocks)
PAIRED_FLAG = 16


def row_bytes(format: str, cols: int) -> int:
    """Bytes of one row of ``cols`` values in ``format``."""
    return cols // BLOCK * BLOCK_BYTES[format]
