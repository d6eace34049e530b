"""Compile every elementwise Triton kernel for a Hopper GPU (sm_90) in bf16, without a GPU.

Triton's interpreter (what the CPU tests run) executes the kernels' Python in numpy and never
lowers them, so a kernel can pass there and still fail to compile for a real GPU (an
unsupported construct, a type mismatch between branches, a bad cast). `triton.compile` runs
the whole lowering, down to ptxas and a cubin, with no GPU present. Run as a script, in a
process without TRITON_INTERPRET (test_kernels_elementwise.py does).
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megapipe.kernels.triton_ops import bias_dropout_add, bias_gelu, rotary, swiglu  # noqa: E402

P, F32, I32, C = "*bf16", "*fp32", "i32", "constexpr"
TILE = {"BM": 16, "BN": 256}
# (kernel, argument types in order, constexprs): the branchiest variant of each kernel; the
# bias_dropout_add forward with an fp32 residual and output beside bf16 x (mixed dtypes)
KERNELS = [
    (bias_gelu._forward, [P, P, P, I32, I32, C, C, C, C], {"HAS_BIAS": True, "TANH": True}),
    (bias_gelu._backward, [P, P, P, P, F32, I32, I32, C, C, C, C],
     {"HAS_BIAS": True, "TANH": False}),
    (bias_dropout_add._forward, [P, P, F32, "*u8", F32, "fp32", I32, I32, C, C, C, C],
     {"HAS_BIAS": True, "HAS_MASK": True}),
    (bias_dropout_add._backward, [P, "*u8", P, F32, "fp32", I32, I32, C, C, C], {"HAS_BIAS": True}),
    (swiglu._forward, [P, P, P, I32, I32, C, C, C], {"HAS_BIAS": True}),
    (swiglu._backward, [P, P, P, P, F32, I32, I32, C, C, C], {"HAS_BIAS": True}),
    (rotary._rotate, [P, F32, F32, P, I32, I32, I32, I32, C, C, C], {"BACKWARD": True}),
]  # fmt: skip


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    for kernel, types, constants in KERNELS:
        names = kernel.arg_names
        assert len(names) == len(types), f"{kernel.__name__}: {names} vs {types}"
        source = ASTSource(kernel, dict(zip(names, types)), {**constants, **TILE})
        compiled = triton.compile(source, target=target)
        assert compiled.asm.get("cubin"), f"{kernel.__name__}: no cubin"
        print(f"{kernel.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}: sm_90 cubin")


if __name__ == "__main__":
    main()
