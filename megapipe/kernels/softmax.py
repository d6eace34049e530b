"""The scaled, masked (or causal) softmax of the unfused attention path: reference and Triton.

    probs = softmax(scores * scale, over keys where allowed), in fp32, cast to scores' dtype

scores: [b, heads, s_q, s_k]. mask: bool, broadcastable to scores (e.g. [b, 1, s_q, s_k] or
[s_q, s_k]), True where a query may attend a key; None means causal with the bottom-right
alignment of a KV cache: query i (of s_q) may attend keys 0 .. i + s_k - s_q, which for
s_q == s_k is the plain lower triangle of `model.attention.explicit_attention`. A row whose keys
are all masked has zeros for probabilities (and zero gradient), not NaN.

The backward is dx = scale * y * (dy - sum(dy * y)) from the saved output y, in fp32; masked
positions have y = 0 and so no gradient. The Triton kernels (`triton_ops/softmax.py`, imported
on first call) keep y in scores' dtype, as Megatron's fused softmax does; the reference, through
autograd, keeps the fp32 y: the two differ by that rounding in bf16 / fp16.
"""

from __future__ import annotations

import torch

from megapipe.kernels.compiled import Compiled


def allowed_keys(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The bool mask (True = may attend) the softmax applies, broadcastable to scores."""
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(
                f"the attention mask must be bool (True = may attend), not {mask.dtype}"
            )
        return mask
    s_q, s_k = scores.shape[-2:]
    return torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).tril(s_k - s_q)


def masked_softmax_reference(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float = 1.0
) -> torch.Tensor:
    """The specification (see the module docstring); differentiable, no NaN anywhere."""
    compute = torch.promote_types(scores.dtype, torch.float32)
    allowed = allowed_keys(scores, mask)
    x = (scores.to(compute) * scale).masked_fill(~allowed, float("-inf"))
    row_max = x.amax(-1, keepdim=True).detach()  # a shift: the softmax does not depend on it
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)  # fully masked rows
    exp = torch.exp(x - row_max)
    total = exp.sum(-1, keepdim=True)
    return (exp / total.masked_fill(total == 0, 1.0)).to(scores.dtype)


def masked_softmax_triton(
    scores: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float = 1.0,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """`masked_softmax_reference` by Triton kernels (4-d scores). block_size: column block."""
    if scores.dim() != 4:
        raise ValueError(f"scores must be [b, heads, s_q, s_k], got shape {tuple(scores.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"the attention mask must be bool (True = may attend), not {mask.dtype}")
    from megapipe.kernels.triton_ops.softmax import MaskedSoftmax

    return MaskedSoftmax.apply(scores, mask, scale, block_size)


IMPLEMENTATIONS = {
    "reference": masked_softmax_reference,
    "triton": masked_softmax_triton,
    "compile": Compiled(masked_softmax_reference),
}
