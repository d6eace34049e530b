"""One pre-norm decoder layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.layers.norms import build_norm
from megapipe.model.attention import SelfAttention
from megapipe.model.mlp import MLP
from megapipe.model.rotary import RotaryEmbedding
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group


def bias_dropout_add(
    x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, training: bool
) -> torch.Tensor:
    """residual + dropout(x + bias): the fusion point for a fused kernel later."""
    if bias is not None:
        x = x + bias
    if training and p > 0:
        x = F.dropout(x, p, training=True)
    return residual + x


class TransformerLayer(torch.nn.Module):
    def __init__(
        self, config: ModelConfig, tp: Group, rng: RNGTracker, *, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        # Megatron scales the init of layers that write into the residual stream.
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        sp = sequence_parallel and tp.size > 1
        eps = config.layernorm_epsilon
        self.input_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp)
        self.self_attention = SelfAttention(
            config, tp, rng, output_init_std=output_std, sequence_parallel=sp
        )
        self.pre_mlp_layernorm = build_norm(config.normalization, config.hidden_size, eps, sp)
        self.mlp = MLP(config, tp, output_init_std=output_std, sequence_parallel=sp)

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out, bias = self.self_attention(self.input_layernorm(x), rotary, attention_mask)
        x = bias_dropout_add(out, bias, x, self.hidden_dropout, self.training)
        out, bias = self.mlp(self.pre_mlp_layernorm(x))
        return bias_dropout_add(out, bias, x, self.hidden_dropout, self.training)
