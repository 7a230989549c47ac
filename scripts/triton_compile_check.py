"""Compile kernels/quant_matmul.py's Triton kernels for a CUDA architecture on a machine without
a GPU: every stored format, float32 / bfloat16 / float16 activations, decode and prefill tiles,
with and without a bias, and the dequantize kernel, through Triton's own compiler and ptxas
(``triton.compile`` with a ``GPUTarget``; nothing is launched). The interpreter
(``TRITON_INTERPRET=1``) runs the kernels' Python and never sees what only the compiler refuses
(a global that is not a ``tl.constexpr(...)``, a construct the code generator lacks); this does,
before a GPU session spends its minutes on it.

    .venv/bin/python scripts/triton_compile_check.py              # sm_90 (H100, H200)
    .venv/bin/python scripts/triton_compile_check.py --arch 80    # A100

Prints one line per variant and exits 1 if any failed to compile.
"""

from __future__ import annotations

import argparse
import sys
import time


def variants():
    """(name, kernel, signature, constexprs) of every compiled variant."""
    from kvmesh.kernels import quant_matmul as qm
    from kvmesh.shared.model.quant_formats import FORMAT_CODES

    for fmt, code in FORMAT_CODES.items():
        half = "*bf16" if fmt == "BF16" else "*fp16"
        for x in ("fp32", "bf16", "fp16"):
            for block_m in (16, 64):
                bias = x == "fp32"  # one variant of each format with a bias pointer
                signature = {
                    "x_ptr": f"*{x}",
                    "u8": "*u8",
                    "i8": "*i8",
                    "h": half,
                    "bias_ptr": f"*{x}" if bias else "constexpr",
                    "y_ptr": f"*{x}",
                    **dict.fromkeys(("M", "N", "K", "rb", "stride_xm", "stride_ym"), "i32"),
                    **dict.fromkeys(
                        ("FMT", "DOT_F32", "BLOCK_M", "BLOCK_N", "BLOCK_K"), "constexpr"
                    ),
                }
                constexprs = dict(FMT=code, DOT_F32=x == "fp32", BLOCK_M=block_m)
                constexprs.update(BLOCK_N=64, BLOCK_K=64, **({} if bias else {"bias_ptr": None}))
                yield (
                    f"quant_matmul {fmt} x {x} rows {block_m}",
                    qm._quant_matmul_kernel,
                    (
                        signature,
                        constexprs,
                    ),
                )
        signature = {"u8": "*u8", "i8": "*i8", "h": half, "out_ptr": "*bf16"}
        signature.update(dict.fromkeys(("N", "K", "rb"), "i32"))
        signature.update(dict.fromkeys(("FMT", "BLOCK_N", "BLOCK_K"), "constexpr"))
        constexprs = dict(FMT=code, BLOCK_N=32, BLOCK_K=64)
        yield f"quant_dequantize {fmt}", qm._dequantize_kernel, (signature, constexprs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100)")
    args = parser.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, kernel, (signature, constexprs) in variants():
        t0 = time.perf_counter()
        try:
            source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
            triton.compile(source, target=target)
        except Exception as exc:  # every variant's outcome, then the exit status
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            print(f"FAIL {name}: {type(cause).__name__}: {cause}", flush=True)
            failed += 1
            continue
        print(f"ok   {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{failed} of the variants failed to compile for sm_{args.arch}" if failed else "all ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
