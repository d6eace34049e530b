"""The feed-forward block: column-parallel fc1 -> GeLU, SwiGLU or squared ReLU ->
row-parallel fc2.

GeLU is the exact erf one, or GPT-2's tanh approximation with --openai-gelu. Squared ReLU
(--squared-relu) is relu(x)^2, plain torch (no fused kernel takes it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.kernels.dispatch import KernelChoices
from megapipe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megapipe.model.fused_ops import fused
from megapipe.parallel.state import Group


class MLP(torch.nn.Module):
    """With SwiGLU, fc1 holds [gate; up] stacked (stride 2: each TP rank keeps a slice of both)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        *,
        output_init_std: float,
        sequence_parallel: bool,
        kernels: KernelChoices | None = None,
    ) -> None:
        super().__init__()
        self.swiglu, self.squared_relu = config.swiglu, config.squared_relu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        # a fused bias + activation kernel takes fc1's bias itself
        self.fused_activation = fused(kernels, "swiglu" if config.swiglu else "bias_gelu")
        if config.squared_relu:
            self.fused_activation = None
        fc1_size = config.ffn_hidden_size * (2 if config.swiglu else 1)
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size,
            fc1_size,
            tp,
            init_std=config.init_method_std,
            bias=config.add_bias_linear,
            sequence_parallel=sequence_parallel,
            stride=2 if config.swiglu else 1,
            skip_bias_add=self.fused_activation is not None,
        )
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size,
            config.hidden_size,
            tp,
            init_std=output_init_std,
            bias=config.add_bias_linear,
            skip_bias_add=True,
            sequence_parallel=sequence_parallel,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h, bias = self.linear_fc1(x)
        if self.fused_activation is not None:
            if self.swiglu:
                h = self.fused_activation(h, bias)
            else:
                h = self.fused_activation(h, bias, self.gelu_approximate)
        elif self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.squared_relu:
            h = torch.square(F.relu(h))
        else:
            h = F.gelu(h, approximate=self.gelu_approximate)
        return self.linear_fc2(h)
