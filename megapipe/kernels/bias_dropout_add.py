"""Bias + dropout + residual add, after attention's and the MLP's output projections:
residual + dropout(x + bias).

The dropout keep-mask is an input, not drawn here: megapipe's masks are layout-invariant
(model/dropout.py, `LogicalDropout.hidden_keep_mask`), so the same mask must reach the fused
and the unfused path. keep: bool or uint8, x's shape, True = kept; scale = 1 / (1 - p).
keep=None is the no-dropout case (evaluation, p = 0): residual + x + bias. bias [cols] may be
None. The output has the promoted dtype of x and residual (an fp32 residual stays fp32).
"""

from __future__ import annotations

import torch

from megapipe.kernels.availability import require_triton_device
from megapipe.kernels.compiled import Compiled


def _check(x, bias, residual, keep) -> None:
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    if bias is not None and bias.shape != x.shape[-1:]:
        raise ValueError(f"bias {tuple(bias.shape)} does not match x's last dim {x.shape[-1]}")
    if keep is not None:
        if keep.shape != x.shape:
            raise ValueError(f"keep mask {tuple(keep.shape)} and x {tuple(x.shape)} differ")
        if keep.dtype not in (torch.bool, torch.uint8):
            raise ValueError(f"keep mask must be bool or uint8, got {keep.dtype}")


def bias_dropout_add_reference(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    keep: torch.Tensor | None = None,
    scale: float = 1.0,
) -> torch.Tensor:
    """The specification: plain torch, autograd through it (the model's unfused formula)."""
    _check(x, bias, residual, keep)
    if bias is not None:
        x = x + bias
    if keep is not None:
        x = x * keep.to(x.dtype).mul_(scale)
    return residual + x


def bias_dropout_add_triton(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    keep: torch.Tensor | None = None,
    scale: float = 1.0,
    *,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The Triton kernels (forward and backward); block: (rows, cols) tile, for tests."""
    _check(x, bias, residual, keep)
    require_triton_device(x)
    from megapipe.kernels.triton_ops.bias_dropout_add import BiasDropoutAdd

    return BiasDropoutAdd.apply(x, bias, residual, keep, scale, block)


IMPLEMENTATIONS = {
    "reference": bias_dropout_add_reference,
    "triton": bias_dropout_add_triton,
    "compile": Compiled(bias_dropout_add_reference),
}
