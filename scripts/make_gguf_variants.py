"""Requantize the shipped SmolLM2 Q4_1 GGUF with llama.cpp's own quantizer and import each result.

    python scripts/make_gguf_variants.py [--out DIR] [--source FILE.gguf] F32 Q8_0 ...

For each format: ``OUT/SmolLM2-135M-Instruct.<FORMAT>.gguf`` (``llama_model_quantize`` of
llama-cpp-python, ``make bench-deps``, with ``allow_requantize``: the Q4_1 values dequantized and
quantized again, so every variant holds the same model) and ``OUT/smollm2-<FORMAT>``, the kvmesh
checkpoint imported from it with the GGUF beside it (formats kept as stored; F32 stays float32).
Existing files are kept. Feeds ``kvmesh bench engine --model OUT/smollm2-<FORMAT> --against
llama.cpp --llama-weights OUT/SmolLM2-135M-Instruct.<FORMAT>.gguf`` (docs/models.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}
SHIPPED = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("formats", nargs="+", choices=sorted(FORMATS))
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvmesh-gguf-variants"))
    parser.add_argument(
        "--source", type=Path, help="the GGUF to requantize (default: the fetched SmolLM2 file)"
    )
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        sys.exit("llama-cpp-python is not installed: run `make bench-deps`")
    from kvmesh.shared.model.fetch import models_dir
    from kvmesh.shared.model.gguf_import import import_gguf

    source = args.source or models_dir() / SHIPPED
    if not source.is_file():
        sys.exit(
            f"{source} not found: run `kvmesh model fetch smollm2-135m-instruct` or pass --source"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.formats:
        gguf = args.out / f"SmolLM2-135M-Instruct.{name}.gguf"
        if not gguf.exists():
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = getattr(llama_cpp, FORMATS[name])
            params.allow_requantize = True
            params.nthread = 2
            partial = gguf.with_suffix(".partial")
            rc = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
            if rc != 0:
                sys.exit(f"llama_model_quantize to {name} failed with {rc}")
            partial.rename(gguf)
        directory = args.out / f"smollm2-{name}"
        if not directory.exists():
            import_gguf(gguf, directory, keep_source=True)
        print(f"{name}: {gguf} ({gguf.stat().st_size / 1e6:.0f} MB), checkpoint {directory}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
