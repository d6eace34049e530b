"""The masked / causal softmax of the unfused attention path: the reference against torch's
softmax in float64 and against `explicit_attention`, the Triton kernels against the reference
(forward and backward, under the interpreter on CPU), fully masked rows as zeros."""

from __future__ import annotations

import pytest
import torch

from megapipe.kernels import softmax as sm
from megapipe.kernels.availability import triton_probe
from megapipe.model.attention import cached_causal_mask, explicit_attention
from megapipe.testing.parity import relative_error

TRITON = triton_probe()
needs_triton = pytest.mark.skipif(not TRITON.available, reason=TRITON.reason)
SCALE = 0.7


def _scores(shape, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 2).to(dtype), torch.randn(shape, generator=gen)


def _mask(b, s_q, s_k, seed=1):
    """A random [b, 1, s_q, s_k] mask with one fully masked row (batch 0, query 1)."""
    mask = torch.rand(b, 1, s_q, s_k, generator=torch.Generator().manual_seed(seed)) > 0.4
    mask[0, 0, 1] = False
    mask[:, :, 0, 0] = True
    return mask


def _run(fn, scores, grad, *args, **kwargs):
    leaf = scores.detach().clone().requires_grad_()
    probs = fn(leaf, *args, **kwargs)
    (probs.float() * grad).sum().backward()
    return probs.detach(), leaf.grad


def test_reference_equals_torch_softmax_in_float64_and_zeros_fully_masked_rows():
    scores, grad = _scores((2, 3, 4, 6))
    scores, grad = scores.double(), grad.double()
    mask = _mask(2, 4, 6)
    probs, dscores = _run(sm.masked_softmax_reference, scores, grad, mask, SCALE)

    def torch_softmax(x):
        return torch.softmax((x * SCALE).masked_fill(~mask, float("-inf")), dim=-1)

    expected, dexpected = _run(torch_softmax, scores, grad)
    live = mask.any(-1, keepdim=True).expand_as(probs)  # rows with at least one key
    errors = (
        relative_error(probs[live], expected[live]),
        relative_error(dscores[live], dexpected[live]),
    )
    print("reference vs torch (float64), probs and grad:", errors)
    assert max(errors) < 1e-14, errors
    assert torch.isnan(expected[~live]).all()  # what torch gives: the reason for the rule
    assert (probs[~live] == 0).all() and (dscores[~live] == 0).all()


def test_reference_matches_explicit_attention_causal_and_masked():
    """What it replaces: with v = identity, explicit_attention returns the probabilities."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 2, 5, 4, generator=gen), torch.randn(2, 2, 5, 4, generator=gen)
    v = torch.eye(5).expand(2, 2, 5, 5)
    scores = q @ k.transpose(-2, -1)
    mask = _mask(2, 5, 5)
    mask[0, 0, 1] = True  # explicit_attention gives NaN for a fully masked row
    for m in (None, mask):
        expected = explicit_attention(q, k, v, m, SCALE, lambda p: p)
        assert relative_error(sm.masked_softmax_reference(scores, m, SCALE), expected) < 1e-6


def test_reference_causal_is_bottom_right_aligned_as_the_kv_cache():
    scores, _ = _scores((1, 2, 3, 7))
    cached = cached_causal_mask(3, 4, scores.device)
    assert torch.equal(
        sm.masked_softmax_reference(scores, None, SCALE),
        sm.masked_softmax_reference(scores, cached, SCALE),
    )
    assert torch.equal(sm.allowed_keys(scores, None), cached)


CASES = [  # (shape, masked, block_size)
    ((1, 2, 5, 5), False, None),  # causal, one padded block
    ((1, 2, 3, 7), False, 4),  # causal with a KV-cache offset, a loop with a ragged tail
    ((2, 2, 3, 9), True, 4),  # a mask broadcast over heads, a fully masked row, a loop
    ((2, 1, 4, 8), True, None),  # one exact block
]


@needs_triton
@pytest.mark.parametrize("shape, masked, block_size", CASES)
def test_triton_softmax_matches_reference_forward_and_backward(shape, masked, block_size):
    scores, grad = _scores(shape)
    mask = _mask(shape[0], shape[2], shape[3]) if masked else None
    probs, dscores = _run(
        sm.masked_softmax_triton, scores, grad, mask, SCALE, block_size=block_size
    )
    expected, dexpected = _run(sm.masked_softmax_reference, scores, grad, mask, SCALE)
    errors = relative_error(probs, expected), relative_error(dscores, dexpected)
    print(f"softmax {shape} masked={masked} block={block_size}: probs, grad", errors)
    assert max(errors) < 1e-5, errors
    assert torch.isfinite(dscores).all()
    if masked:
        assert (probs[0, :, 1] == 0).all() and (dscores[0, :, 1] == 0).all()


@needs_triton
def test_triton_softmax_keeps_the_input_dtype():
    scores, grad = _scores((1, 2, 4, 6), dtype=torch.bfloat16)
    probs, dscores = _run(sm.masked_softmax_triton, scores, grad, None, SCALE)
    expected, dexpected = _run(sm.masked_softmax_reference, scores, grad, None, SCALE)
    assert probs.dtype == dscores.dtype == torch.bfloat16
    errors = relative_error(probs, expected), relative_error(dscores, dexpected)
    print("softmax bf16: probs, grad", errors)
    assert max(errors) < 1e-2, errors  # bf16 rounding; the kernel's backward reads bf16 probs


def test_bad_masks_are_refused():
    scores = torch.zeros(1, 1, 2, 2)
    with pytest.raises(TypeError, match="must be bool"):
        sm.masked_softmax_reference(scores, torch.ones(2, 2), SCALE)
    with pytest.raises(ValueError, match=r"\[b, heads, s_q, s_k\]"):
        sm.masked_softmax_triton(scores[0], None, SCALE)
