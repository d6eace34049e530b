"""Rotary position embedding applied to q or k: megapipe's non-interleaved "rotate half" form
(model/rotary.py), x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1].

x: [s, b, heads, d] (d even); cos, sin: the tables of `RotaryEmbedding` ([positions, 1, 1, d]
or [positions, d]), of which positions offset..offset+s-1 are used (offset > 0 for the new
tokens of a generation step after a KV cache). The tables get no gradient and are fp32 (also
in bf16 models, model/rotary.py). Both implementations compute in fp32 (the reference in x's
dtype where that is wider: float64 for the tests' exact runs) and cast the result to x's dtype.
"""

from __future__ import annotations

import torch

from megapipe.kernels.availability import require_triton_device
from megapipe.kernels.compiled import Compiled


def _tables(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int):
    """The tables as [positions, d], checked against x and the offset."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rotary needs x [s, b, heads, d] with d even, got {tuple(x.shape)}")
    d = x.shape[-1]
    cos, sin = cos.reshape(-1, d), sin.reshape(-1, d)
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} tables differ")
    if offset < 0 or offset + x.shape[0] > cos.shape[0]:
        raise ValueError(
            f"positions {offset}..{offset + x.shape[0] - 1} are outside the tables' "
            f"{cos.shape[0]} positions"
        )
    return cos, sin


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0
) -> torch.Tensor:
    """The specification: plain torch, autograd through it (the model's formula)."""
    cos, sin = _tables(x, cos, sin, offset)
    end = offset + x.shape[0]
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    cos = cos[offset:end, None, None, :].to(math_dtype)
    sin = sin[offset:end, None, None, :].to(math_dtype)
    wide = x.to(math_dtype)
    first, second = wide.chunk(2, dim=-1)
    return (wide * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def rotary_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    offset: int = 0,
    *,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernel (forward and backward); block: (rows, half-d) tile, for tests."""
    cos, sin = _tables(x, cos, sin, offset)
    require_triton_device(x)
    from megapipe.kernels.triton_ops.rotary import Rotary

    return Rotary.apply(x, cos, sin, int(offset), block)


IMPLEMENTATIONS = {
    "reference": rotary_reference,
    "triton": rotary_triton,
    "compile": Compiled(rotary_reference),
}
