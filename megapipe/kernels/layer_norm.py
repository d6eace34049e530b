"""LayerNorm and RMSNorm over the last dimension: the plain-torch references and Triton kernels.

Semantics are those of `megapipe.layers.norms` (torch's `F.layer_norm` / `F.rms_norm`, eps 1e-5
by default there):

    LayerNorm: y = (x - mean) / sqrt(var + eps) * weight + bias   (biased variance)
    RMSNorm:   y = x / sqrt(mean(x^2) + eps) * weight            (Megatron's RMSNorm)

Statistics and arithmetic are fp32 whatever the input dtype (fp64 stays fp64 in the
references); the output has x's dtype, the gradients those of x, weight and bias. Weight and
bias gradients are sums over this rank's rows only: under sequence parallelism their TP
reduction stays where it is (`ParamMeta.sequence_parallel` on the module's parameters), so the
kernels are drop-in for `F.layer_norm` / `F.rms_norm` inside those modules.

Two ops, two tables: `LAYER_NORM_IMPLEMENTATIONS` ("layer_norm") and
`RMS_NORM_IMPLEMENTATIONS` ("rms_norm"); the Triton kernels are shared
(`triton_ops/layer_norm.py`, imported on first call). apex's and TransformerEngine's fused
norms are the "apex" and "te" rows (kernels/norm_backends.py), also imported on first call.
"""

from __future__ import annotations

import torch

from megapipe.kernels.compiled import Compiled
from megapipe.kernels.norm_backends import (
    apex_layer_norm,
    apex_rms_norm,
    te_layer_norm,
    te_rms_norm,
)


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """The specification: LayerNorm over the last dimension (see the module docstring)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(-1, keepdim=True)
    centred = xf - mean
    var = centred.square().mean(-1, keepdim=True)
    y = centred * torch.rsqrt(var + eps) * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """The specification: Megatron's RMSNorm over the last dimension."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(compute)).to(x.dtype)


def layer_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    block_size: int | None = None,
) -> torch.Tensor:
    """`layer_norm_reference` by Triton kernels; block_size: column block (tests)."""
    _check(x, weight, bias)
    from megapipe.kernels.triton_ops.layer_norm import Norm

    return Norm.apply(x, weight, bias, eps, False, block_size)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, block_size: int | None = None
) -> torch.Tensor:
    """`rms_norm_reference` by Triton kernels; block_size: column block (tests)."""
    _check(x, weight, None)
    from megapipe.kernels.triton_ops.layer_norm import Norm

    return Norm.apply(x, weight, None, eps, True, block_size)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None and param.shape != x.shape[-1:]:
            raise ValueError(
                f"{name} {tuple(param.shape)} does not match x's last dim {x.shape[-1]}"
            )


LAYER_NORM_IMPLEMENTATIONS = {
    "reference": layer_norm_reference,
    "triton": layer_norm_triton,
    "compile": Compiled(layer_norm_reference),
    "apex": apex_layer_norm,
    "te": te_layer_norm,
}
RMS_NORM_IMPLEMENTATIONS = {
    "reference": rms_norm_reference,
    "triton": rms_norm_triton,
    "compile": Compiled(rms_norm_reference),
    "apex": apex_rms_norm,
    "te": te_rms_norm,
}
