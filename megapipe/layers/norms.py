"""LayerNorm and RMSNorm whose parameters carry TP metadata (replicated across TP ranks)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megapipe.layers.param_meta import ParamMeta, make_param


def _replicated(hidden_size: int, fill: float, sequence_parallel: bool) -> torch.nn.Parameter:
    """A norm parameter: the same on every TP rank, summed over the sequence under SP."""
    meta = ParamMeta((hidden_size,), init_fill=fill, sequence_parallel=sequence_parallel)
    return make_param(meta, 1)


class LayerNorm(torch.nn.Module):
    """kernel: a fused implementation (x, weight, bias, eps) -> y, or None for F.layer_norm."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        kernel: Callable[..., torch.Tensor] | None = None,
    ):
        super().__init__()
        self.eps, self.kernel = eps, kernel
        self.weight = _replicated(hidden_size, 1.0, sequence_parallel)
        self.bias = _replicated(hidden_size, 0.0, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.Module):
    """kernel: a fused implementation (x, weight, eps) -> y, or None for F.rms_norm."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        sequence_parallel: bool = False,
        kernel: Callable[..., torch.Tensor] | None = None,
    ):
        super().__init__()
        self.eps, self.kernel = eps, kernel
        self.weight = _replicated(hidden_size, 1.0, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def build_norm(
    kind: str,
    hidden_size: int,
    eps: float,
    sequence_parallel: bool,
    kernel: Callable[..., torch.Tensor] | None = None,
) -> torch.nn.Module:
    """The norm named by --normalization (kernel: its fused implementation, if any)."""
    norms = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
    return norms[kind](hidden_size, eps, sequence_parallel, kernel)
