"""LayerNorm and RMSNorm whose parameters carry TP metadata (replicated across TP ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.layers.param_meta import ParamMeta, make_param


class LayerNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = make_param(
            ParamMeta((hidden_size,), init_fill=1.0, sequence_parallel=sequence_parallel), 1
        )
        self.bias = make_param(
            ParamMeta((hidden_size,), init_fill=0.0, sequence_parallel=sequence_parallel), 1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = make_param(
            ParamMeta((hidden_size,), init_fill=1.0, sequence_parallel=sequence_parallel), 1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def build_norm(kind: str, hidden_size: int, eps: float, sequence_parallel: bool) -> torch.nn.Module:
    """The norm named by --normalization."""
    norms = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}
    return norms[kind](hidden_size, eps, sequence_parallel)
