"""The "apex" and "te" rows of the norm ops: NVIDIA apex's fused LayerNorm / RMSNorm and
TransformerEngine's, called with megapipe's own weight and bias (the reference's signature).

Each imports its library on the first call only (dispatch chooses them only on CUDA where the
probe found them; kernels/availability.py). apex's functional forms take the parameters as
arguments. TE's norms are modules that own their parameters, so the "te" row keeps one module
per (size, eps, dtype, device) and runs it with ours through `torch.func.functional_call`,
which substitutes parameters for the call and keeps autograd to them. Both compute their
statistics in fp32 and return x's dtype, as the reference does.
"""

from __future__ import annotations

import importlib

import torch


def _cuda_only(library: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise RuntimeError(
            f"{library}'s fused norms need CUDA tensors (got {x.device.type}); use the reference"
        )


def apex_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """`layer_norm_reference` by apex's FusedLayerNorm kernel."""
    _cuda_only("apex", x)
    fused = importlib.import_module("apex.normalization.fused_layer_norm")
    if bias is None:  # apex's affine form always adds a bias
        bias = torch.zeros_like(weight)
    return fused.fused_layer_norm_affine(x, weight, bias, weight.shape, eps)


def apex_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`rms_norm_reference` by apex's FusedRMSNorm kernel."""
    _cuda_only("apex", x)
    fused = importlib.import_module("apex.normalization.fused_layer_norm")
    return fused.fused_rms_norm_affine(x, weight, weight.shape, eps)


class TENorm:
    """TransformerEngine's LayerNorm or RMSNorm ("LayerNorm" / "RMSNorm") run with given
    parameters. The only state: the TE modules built so far, one per (hidden size, eps, dtype,
    device), whose own parameters are never used."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._modules: dict[tuple, torch.nn.Module] = {}

    def run(self, x: torch.Tensor, params: dict[str, torch.Tensor], eps: float) -> torch.Tensor:
        _cuda_only("TransformerEngine", x)
        weight = params["weight"]
        key = (weight.shape[0], eps, weight.dtype, x.device)
        if key not in self._modules:
            te = importlib.import_module("transformer_engine.pytorch")
            self._modules[key] = getattr(te, self.kind)(
                weight.shape[0], eps=eps, params_dtype=weight.dtype, device=x.device
            )
        return torch.func.functional_call(self._modules[key], params, (x,))


_TE_LAYER_NORM, _TE_RMS_NORM = TENorm("LayerNorm"), TENorm("RMSNorm")


def te_layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """`layer_norm_reference` by TransformerEngine's LayerNorm kernel."""
    bias = bias if bias is not None else torch.zeros_like(weight)
    return _TE_LAYER_NORM.run(x, {"weight": weight, "bias": bias}, eps)


def te_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """`rms_norm_reference` by TransformerEngine's RMSNorm kernel."""
    return _TE_RMS_NORM.run(x, {"weight": weight}, eps)
