"""The norm, softmax and cross-entropy Triton kernels compile for a real GPU (sm_90, bf16
data, the launch constants the wrappers use) on this CPU: Triton's interpreter, which the
other kernel tests run on, checks no types, so a kernel could pass them and fail to compile.

Compilation runs in a subprocess without TRITON_INTERPRET (this process has the interpreter on),
through `triton.compile` with an explicit target: no GPU or driver needed, only Triton's NVIDIA
backend and its bundled ptxas.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megapipe.kernels.availability import triton_probe

TRITON = triton_probe()

_SCRIPT = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from megapipe.kernels.triton_ops import cross_entropy as ce, layer_norm as ln, softmax as sm

    D = "*bf16"
    NORM_FWD = dict(X=D, W=D, B=D, Y=D, MEAN="*fp32", RSTD="*fp32", width="i32",
                    stride_x="i32", stride_y="i32", eps="fp32")
    NORM_BWD = dict(X=D, DY=D, W=D, MEAN="*fp32", RSTD="*fp32", DX=D, PARTIAL_W="*fp32",
                    PARTIAL_B="*fp32", rows="i32", width="i32", stride_x="i32",
                    stride_dy="i32", stride_dx="i32", rows_per_program="i32")
    SOFTMAX_FWD = dict(S=D, MASK="*u8", P=D, heads="i32", s_q="i32", s_k="i32", mask_sb="i32",
                       mask_sh="i32", mask_sq="i32", mask_sk="i32", scale="fp32")
    SOFTMAX_BWD = dict(P=D, DP=D, DS=D, s_k="i32", scale="fp32")
    CE_FWD = dict(X=D, T="*i64", MAX="*fp32", SUM="*fp32", TARGET="*fp32", stride_x="i32",
                  valid="i32")
    CE_BWD = dict(X=D, T="*i64", LSE="*fp32", DLOSS="*fp32", DX=D, stride_x="i32",
                  stride_dx="i32", local="i32", valid="i32")
    CASES = [  # (kernel, signature, constants, num_warps)
        (ln._norm_forward, NORM_FWD, dict(RMS=False, HAS_BIAS=True, BLOCK=8192), 16),
        (ln._norm_forward, NORM_FWD, dict(RMS=True, HAS_BIAS=False, BLOCK=1024), 4),
        (ln._norm_backward, NORM_BWD, dict(RMS=False, HAS_BIAS=True, ONE_BLOCK=True,
                                           BLOCK=8192), 16),
        (ln._norm_backward, NORM_BWD, dict(RMS=True, HAS_BIAS=False, ONE_BLOCK=False,
                                           BLOCK=1024), 4),
        (sm._softmax_forward, SOFTMAX_FWD, dict(CAUSAL=True, BLOCK=2048), 8),
        (sm._softmax_forward, SOFTMAX_FWD, dict(CAUSAL=False, BLOCK=4096), 16),
        (sm._softmax_backward, SOFTMAX_BWD, dict(BLOCK=4096), 16),
        (ce._ce_forward, CE_FWD, dict(BLOCK=4096), 8),
        (ce._ce_backward, CE_BWD, dict(BLOCK=4096), 8),
    ]
    for capability in map(int, sys.argv[1:]):
        for kernel, signature, constants, warps in CASES:
            signature = {**signature, **{name: "constexpr" for name in constants}}
            source = ASTSource(kernel, signature, constexprs=constants)
            try:
                triton.compile(source, target=GPUTarget("cuda", capability, 32),
                               options={"num_warps": warps})
            except Exception as error:
                if "ptxas" in str(error).lower():
                    print("SKIP: no usable ptxas:", str(error).splitlines()[0])
                    sys.exit(0)
                raise
            print("compiled", kernel.__name__, f"sm_{capability}", constants)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not TRITON.available, reason=TRITON.reason)
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia", reason="Triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "90"],  # one target: ~1 s of CPU per kernel
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    assert done.stdout.count("compiled") == 9, done.stdout
