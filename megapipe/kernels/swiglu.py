"""SwiGLU, the MLP's gated activation: silu(gate) * up.

fc1's output h holds [gate; up] concatenated on the last dim (2f wide; under TP each rank's
shard is its own [gate; up], model/mlp.py), and the result is f wide. bias [2f] (fc1's bias
when the MLP defers it, Megatron's bias_swiglu) may be None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.kernels.availability import require_triton_device
from megapipe.kernels.compiled import Compiled


def _check(h: torch.Tensor, bias: torch.Tensor | None) -> None:
    if h.shape[-1] % 2:
        raise ValueError(f"SwiGLU needs an even last dim ([gate; up]), got {h.shape[-1]}")
    if bias is not None and bias.shape != h.shape[-1:]:
        raise ValueError(f"bias {tuple(bias.shape)} does not match h's last dim {h.shape[-1]}")


def swiglu_reference(h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The specification: plain torch, autograd through it."""
    _check(h, bias)
    if bias is not None:
        h = h + bias
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_triton(
    h: torch.Tensor, bias: torch.Tensor | None = None, *, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The Triton kernels (forward and backward); block: (rows, cols) tile, for tests."""
    _check(h, bias)
    require_triton_device(h)
    from megapipe.kernels.triton_ops.swiglu import SwiGLU

    return SwiGLU.apply(h, bias, block)


IMPLEMENTATIONS = {
    "reference": swiglu_reference,
    "triton": swiglu_triton,
    "compile": Compiled(swiglu_reference),
}
