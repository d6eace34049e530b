"""LayerNorm and RMSNorm kernels: the references against torch's norms in float64, the Triton
kernels (forward and backward, under the interpreter on CPU) against the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megapipe.kernels import layer_norm as ln
from megapipe.kernels.availability import triton_probe
from megapipe.layers.norms import LayerNorm, RMSNorm
from megapipe.testing.parity import relative_error

TRITON = triton_probe()
needs_triton = pytest.mark.skipif(not TRITON.available, reason=TRITON.reason)
EPS = 1e-5


def _inputs(width: int, rows: tuple[int, ...] = (2, 3), dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*rows, width, generator=gen) * 2 + 0.5).to(dtype)
    weight = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
    bias = (0.3 * torch.randn(width, generator=gen)).to(dtype)
    grad_y = torch.randn(*rows, width, generator=gen).to(dtype)
    return x, weight, bias, grad_y


def _run(fn, grad_y, *tensors):
    """fn(*tensors) and the gradients of sum(fn * grad_y) with respect to the tensors."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in tensors]
    y = fn(*leaves)
    (y.float() * grad_y.float()).sum().backward()
    return [y.detach()] + [t.grad for t in leaves if t is not None]


def test_references_equal_torch_norms_in_float64():
    x, w, b, dy = (t.double() for t in _inputs(37))
    for ours, theirs in [
        (
            _run(lambda *a: ln.layer_norm_reference(*a, EPS), dy, x, w, b),
            _run(lambda x, w, b: F.layer_norm(x, (37,), w, b, EPS), dy, x, w, b),
        ),
        (
            _run(lambda *a: ln.rms_norm_reference(*a, EPS), dy, x, w),
            _run(lambda x, w: F.rms_norm(x, (37,), w, EPS), dy, x, w),
        ),
    ]:
        errors = [relative_error(a, e) for a, e in zip(ours, theirs)]
        print("reference vs torch (float64): y, dx, dw[, db]", errors)
        assert max(errors) < 1e-13, errors


def test_references_match_megapipe_norm_modules():
    """Same eps default and formula as the modules the model builds (fp32)."""
    x, w, b, _ = _inputs(16)
    layer, rms = LayerNorm(16), RMSNorm(16)
    with torch.no_grad():
        layer.weight.copy_(w), layer.bias.copy_(b), rms.weight.copy_(w)
        assert relative_error(ln.layer_norm_reference(x, w, b), layer(x)) < 1e-6
        assert relative_error(ln.rms_norm_reference(x, w), rms(x)) < 1e-6


CASES = [  # (width, block_size): one exact block, one padded block, a loop with a ragged tail
    (16, None),
    (37, None),
    (37, 16),
]


@needs_triton
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("width, block_size", CASES)
def test_triton_norm_matches_reference_forward_and_backward(rms, width, block_size):
    x, w, b, dy = _inputs(width)
    if rms:
        fused = lambda x, w: ln.rms_norm_triton(x, w, EPS, block_size=block_size)
        ours, ref = _run(fused, dy, x, w), _run(lambda *a: ln.rms_norm_reference(*a, EPS), dy, x, w)
    else:
        fused = lambda x, w, b: ln.layer_norm_triton(x, w, b, EPS, block_size=block_size)
        ours = _run(fused, dy, x, w, b)
        ref = _run(lambda *a: ln.layer_norm_reference(*a, EPS), dy, x, w, b)
    errors = [relative_error(a, e) for a, e in zip(ours, ref)]
    print(
        f"{'rms' if rms else 'layer'}_norm width {width} block {block_size}: y, dx, dw[, db]",
        errors,
    )
    assert max(errors) < 1e-5, errors


@needs_triton
def test_triton_layer_norm_without_bias_and_a_single_row():
    x, w, _, dy = _inputs(24, rows=(1,))
    fused = lambda x, w: ln.layer_norm_triton(x, w, None, EPS)
    errors = [
        relative_error(a, e)
        for a, e in zip(
            _run(fused, dy, x, w), _run(lambda x, w: ln.layer_norm_reference(x, w, None), dy, x, w)
        )
    ]
    assert max(errors) < 1e-5, errors


@needs_triton
@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_triton_norm_keeps_dtypes_and_uses_fp32_statistics(rms):
    """bf16 in, bf16 out and bf16 grads; the statistics are fp32, so the output equals the
    reference (which computes in fp32 and casts once) to bf16 rounding, and a large mean
    does not wash out the variance."""
    x, w, b, dy = _inputs(20, dtype=torch.bfloat16)
    x = x + 64  # a bf16 variance computed in bf16 would lose most of its digits
    args = (x, w) if rms else (x, w, b)
    fused = ln.rms_norm_triton if rms else ln.layer_norm_triton
    ref = ln.rms_norm_reference if rms else ln.layer_norm_reference
    ours, expected = _run(fused, dy, *args), _run(ref, dy, *args)
    assert all(t.dtype == torch.bfloat16 for t in ours)
    errors = [relative_error(a, e) for a, e in zip(ours, expected)]
    print(f"{'rms' if rms else 'layer'}_norm bf16: y, dx, dw[, db]", errors)
    assert max(errors) < 1e-2, errors  # one bf16 rounding of outputs and grads (8 bits)
