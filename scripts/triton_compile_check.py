"""Compile kvmesh's Triton kernels for a CUDA architecture on a machine without a GPU:
kernels/quant_matmul.py for every stored format, float32 / bfloat16 / float16 activations,
decode and prefill tiles, with and without a bias, and its dequantize kernel; the paged
attention kernel (kernels/paged_attention_kernel.py) for a bf16, int8 and fp8 cache, decode and
tree rows, at Llama-3.2-1B's head shape; the KV pack kernel (kernels/kv_pack.py) for 2-byte
elements, with and without zero fill. Through Triton's own compiler and ptxas
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

# quant_matmul's integer arguments (sizes, strides, the split-K range)
_INT_ARGS = ("M", "N", "K", "rb", "stride_xm", "stride_ym", "k_split", "stride_ys")


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
                    **dict.fromkeys(_INT_ARGS, "i32"),
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


def other_variants():
    """The attention and KV pack kernels' variants (their launch arguments' types as
    ``launch`` and ``pack_blocks`` pass them)."""
    from kvmesh.kernels import kv_pack
    from kvmesh.kernels import paged_attention_kernel as pk

    modes = {"bf16": (pk._PLAIN, "*bf16", "*i64"), "int8": (pk._INT8, "*i8", "*fp32")}
    modes["fp8"] = (pk._FP8, "*u8", "*fp32")  # fp8 caches are read as bytes through a table
    for name, (mode, cache, scales) in modes.items():
        for tree in (False, True):
            signature = {}
            for arg in pk._paged_attention_kernel.arg_names:
                if arg.isupper():
                    signature[arg] = "constexpr"
                elif arg in ("out_ptr", "q_ptr"):
                    signature[arg] = "*bf16"
                elif arg in ("k_ptr", "v_ptr"):
                    signature[arg] = cache
                elif arg in ("k_scale_ptr", "v_scale_ptr"):
                    signature[arg] = scales
                elif arg == "lut_ptr":
                    signature[arg] = "*fp32" if name == "fp8" else "*i64"
                elif arg == "rot_ptr":
                    signature[arg] = "*fp32" if name == "int8" else "*i64"
                else:
                    signature[arg] = "*i64" if arg.endswith("_ptr") else "i32"
            signature["scale"] = "fp32"
            constexprs = dict(IS_TREE=tree, KV_MODE=mode, SCALE_GROUP=32, GROUP=4, HEAD_DIM=64)
            constexprs.update(BLOCK_SIZE=16, GROUP_PAD=4, DIM_PAD=64, TOKENS_PAD=16)
            rows = "tree" if tree else "decode"
            yield (
                f"paged_attention {name} cache, {rows} rows",
                pk._paged_attention_kernel,
                (
                    signature,
                    constexprs,
                ),
            )
    for zero_fill in (False, True):
        signature = {}
        for arg in kv_pack._copy_tokens_kernel.arg_names:
            if arg.isupper():
                signature[arg] = "constexpr"
            elif arg in ("src_ptr", "dst_ptr"):
                signature[arg] = "*i16"
            else:
                signature[arg] = "*i64" if arg.endswith("_ptr") else "i32"
        constexprs = dict(NUM_LAYERS=16, NUM_ROWS=128, HEAD_DIM=64, SRC_BS=16, DST_BS=32, ROWS=2)
        constexprs.update(ELEMS=2048, ZERO_FILL=zero_fill)  # 4 heads of 16 layers, 16 -> 32
        yield (
            f"kv_pack copy_tokens zero_fill={zero_fill}",
            kv_pack._copy_tokens_kernel,
            (
                signature,
                constexprs,
            ),
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100)")
    args = parser.parse_args(argv)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, kernel, (signature, constexprs) in [*variants(), *other_variants()]:
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
