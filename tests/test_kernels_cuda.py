"""Every fused implementation in the dispatch table against an fp64 reference, on CUDA, in fp32,
bf16 and fp16, forward and backward (skipped without a CUDA device; tools/gpu_check.sh runs it).

For each op of `kernels.dispatch.IMPLEMENTATIONS` and each of its fused rows (Triton, apex,
TransformerEngine; torch.compile too with MEGAPIPE_TEST_COMPILE=1) the op runs on the case's
inputs (`megapipe/testing/kernel_cases.py`, sizes that are not multiples of the block sizes) in
the test's dtype, and the reference runs on the same values in fp64. The error of each output
and input gradient is max |got - fp64| / max |fp64|; a non-finite value is an infinite error,
so a NaN never passes. The bound is the dtype's tolerance or twice the error of the reference itself
run in that dtype, whichever is larger (a fused kernel may not be less exact than plain torch
in the same precision by more than that).
"""

from __future__ import annotations

import os

import pytest
import torch

from megapipe.kernels.availability import detect
from megapipe.kernels.dispatch import IMPLEMENTATIONS, REQUIRES
from megapipe.testing.kernel_cases import CASES, Sizes, as_dtype, forward_backward, max_error

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
# Not multiples of 64/128 anywhere: partial tiles in every kernel.
SIZES = Sizes(tokens=1000, hidden=1000, ffn=2728, heads=10, micro_batch=2)  # head_dim 100
FUSED = ("triton", "apex", "te") + (("compile",) if os.environ.get("MEGAPIPE_TEST_COMPILE") else ())

PAIRS = [
    pytest.param(index, impl, id=f"{case.op}{index}-{impl}")
    for index, case in enumerate(CASES)
    for impl in FUSED
    if impl in IMPLEMENTATIONS[case.op]
]


@pytest.fixture(scope="module")
def available():
    return detect()


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("index, impl", PAIRS)
def test_fused_matches_the_fp64_reference(index, impl, dtype_name, available) -> None:
    probe = getattr(available, REQUIRES[impl])
    if not probe.available:
        pytest.skip(f"{impl}: {probe.reason}")
    case, dtype, device = CASES[index], DTYPES[dtype_name], torch.device("cuda")
    table = IMPLEMENTATIONS[case.op]
    inputs = case.make(SIZES, dtype, device, torch.Generator(device=device).manual_seed(0))
    exact = as_dtype(inputs, torch.float64)
    with torch.no_grad():
        shape = table["reference"](*exact.args).shape
    grad = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(1),
                       device=device).to(dtype)  # fmt: skip
    want = forward_backward(table["reference"], exact, grad.double())
    got = forward_backward(table[impl], inputs, grad)
    plain = forward_backward(table["reference"], as_dtype(inputs, None), grad)
    assert got[0].dtype == plain[0].dtype, "output dtype"
    bound = max(TOLERANCE[dtype], 2 * max_error(plain, want))
    error = max_error(got, want)
    assert error <= bound, f"{case.op} {impl} {dtype_name}: error {error:.3e} > {bound:.3e}"
