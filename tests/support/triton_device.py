"""Where the Triton kernels' tests run: CUDA with the compiled kernels, or the CPU under the
interpreter (``TRITON_INTERPRET=1``, set by `make test`); ``needs_triton`` skips a test where
neither is there."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
needs_triton = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
