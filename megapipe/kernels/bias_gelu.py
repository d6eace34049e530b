"""Bias + GeLU, the MLP's activation after fc1: gelu(x + bias).

approximate="none" is the exact erf GeLU; "tanh" is GPT-2's approximation (Megatron's
--openai-gelu, `F.gelu(..., approximate="tanh")`). bias [cols] may be None (--disable-bias-
linear). Every implementation has the reference's signature.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.kernels.availability import require_triton_device
from megapipe.kernels.compiled import Compiled

APPROXIMATIONS = ("none", "tanh")


def _check(x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias {tuple(bias.shape)} does not match x's last dim {x.shape[-1]}")


def bias_gelu_reference(
    x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none"
) -> torch.Tensor:
    """The specification: plain torch, autograd through it."""
    _check(x, bias, approximate)
    return F.gelu(x + bias if bias is not None else x, approximate=approximate)


def bias_gelu_triton(
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "none",
    *,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernels (forward and backward); block: (rows, cols) tile, for tests."""
    _check(x, bias, approximate)
    require_triton_device(x)
    from megapipe.kernels.triton_ops.bias_gelu import BiasGeLU

    return BiasGeLU.apply(x, bias, approximate, block)


IMPLEMENTATIONS = {
    "reference": bias_gelu_reference,
    "triton": bias_gelu_triton,
    "compile": Compiled(bias_gelu_reference),
}
