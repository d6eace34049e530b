"""One pre-norm decoder layer: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

With --apply-residual-connection-post-layernorm each residual is the norm's output instead:
n + drop(attn(n)) with n = norm(x), likewise for the MLP. The norm's output is a sequence
shard under sequence parallelism, as x is, so the residual add stays local either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from megapipe.config import KernelConfig, ModelConfig, RecomputeConfig
from megapipe.kernels.dispatch import KernelChoices
from megapipe.kernels.transformer_engine import FP8Scope
from megapipe.layers.norms import build_norm
from megapipe.model.attention import SelfAttention
from megapipe.model.dropout import LogicalDropout
from megapipe.model.fused_ops import fused
from megapipe.model.kv_cache import KVCache
from megapipe.model.mlp import MLP
from megapipe.model.moe import MoELayer
from megapipe.model.moe_losses import MoELosses
from megapipe.model.recompute import recompute, wanted
from megapipe.model.rotary import RotaryEmbedding
from megapipe.model.te_layers import chunk_fp8_scope, use_transformer_engine
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
    drop: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """residual + dropout(x + bias): the fusion point for a fused kernel later.

    drop: applies layout-invariant dropout (model/dropout.py); None draws from torch's stream.
    """
    if bias is not None:
        x = x + bias
    if training and p > 0:
        x = drop(x) if drop is not None else F.dropout(x, p, training=True)
    return residual + x


class TransformerLayer(torch.nn.Module):
    """layer_number: the layer's global index (keys its dropout masks, whichever stage holds it)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        rng: RNGTracker,
        *,
        sequence_parallel: bool,
        layer_number: int = 0,
        recompute: RecomputeConfig | None = None,
        kernels: KernelConfig | None = None,
        choices: KernelChoices | None = None,
        fp8_scope: FP8Scope | None = None,
        cp: Group | None = None,
        moe_losses: MoELosses | None = None,
        ep: Group | None = None,
    ) -> None:
        """choices: the fused kernels chosen for this run (None: plain torch everywhere);
        fp8_scope: the chunk's FP8 autocast (TE layers; default: the layer's own);
        cp: the context-parallel group (None: one rank holds whole sequences);
        moe_losses: where an MoE layer records its auxiliary losses (the model's);
        ep: the expert-parallel group an MoE layer splits its experts over (None: one rank)."""
        super().__init__()
        recompute = recompute or RecomputeConfig()
        kernels = kernels or KernelConfig()
        norm_op = "layer_norm" if config.normalization == "LayerNorm" else "rms_norm"
        norm_kernel = fused(choices, norm_op)
        self.fused_bias_dropout_add = fused(choices, "bias_dropout_add")
        self.rng = rng
        self.layer_number = layer_number
        self.recompute_mlp = recompute.selective("mlp")
        self.hidden_dropout = config.hidden_dropout
        self.residual_post_norm = config.apply_residual_connection_post_layernorm
        # Megatron scales the init of layers that write into the residual stream.
        output_std = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        sp = sequence_parallel and tp.size > 1
        eps = config.layernorm_epsilon
        self.input_layernorm = build_norm(
            config.normalization, config.hidden_size, eps, sp, norm_kernel
        )
        self.self_attention = SelfAttention(
            config,
            tp,
            rng,
            output_init_std=output_std,
            sequence_parallel=sp,
            layer_number=layer_number,
            recompute_core=recompute.selective("core_attn"),
            backend=kernels.attention_backend,
            softmax_kernel=fused(choices, "masked_softmax"),
            dropout_rng=kernels.attention_dropout_rng,
            cp=cp,
            cp_comm_type=kernels.cp_comm_type,
            cp_emulate_nccl_order=kernels.emulate_nccl_p2p_order,
        )
        self.pre_mlp_layernorm = build_norm(
            config.normalization, config.hidden_size, eps, sp, norm_kernel
        )
        if config.is_moe_layer(layer_number):
            self.mlp = MoELayer(
                config,
                tp,
                output_init_std=output_std,
                layer_number=layer_number,
                losses=moe_losses,
                ep=ep,
                sequence_parallel=sp,
                cp=cp,
            )
        else:
            self.mlp = MLP(
                config, tp, output_init_std=output_std, sequence_parallel=sp, kernels=choices
            )
        self.fp8_scope = FP8Scope(None)
        if kernels.transformer_impl == "transformer_engine":  # TE's linears and fused norms
            self.fp8_scope = fp8_scope if fp8_scope is not None else chunk_fp8_scope(kernels, tp)
            use_transformer_engine(
                self,
                config,
                tp,
                kernels,
                sequence_parallel=sp,
                output_init_std=output_std,
                fp8_scope=self.fp8_scope,
            )

    def forward(
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding | None = None,
        attention_mask: torch.Tensor | None = None,
        dropout_masks: LogicalDropout | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        p = self.hidden_dropout
        drop_attention = drop_mlp = None
        if dropout_masks is not None:
            drop = partial(dropout_masks.hidden, p=p, layer=self.layer_number)
            drop_attention = partial(drop, site="attention_output")
            drop_mlp = partial(drop, site="mlp_output")
        normed = self.input_layernorm(x)
        out, bias = self.self_attention(normed, rotary, attention_mask, dropout_masks, kv_cache)
        residual = normed if self.residual_post_norm else x
        x = self._residual(out, bias, residual, dropout_masks, "attention_output", drop_attention)
        normed = self.pre_mlp_layernorm(x)
        if self.recompute_mlp and wanted(self):
            mlp = self.fp8_scope.wrap(self.mlp)  # recomputed in backward: in FP8 again
            out, bias = recompute(mlp, normed, rng=self.rng)
        else:
            out, bias = self.mlp(normed)
        residual = normed if self.residual_post_norm else x
        return self._residual(out, bias, residual, dropout_masks, "mlp_output", drop_mlp)

    def _residual(self, out, bias, x, dropout_masks, site: str, drop) -> torch.Tensor:
        """x + dropout(out + bias), by the fused kernel where one was chosen (it takes the
        layout-invariant keep-mask; stream dropout without sample ids stays plain torch)."""
        p = self.hidden_dropout
        dropping = self.training and p > 0
        if self.fused_bias_dropout_add is None or (dropping and dropout_masks is None):
            return bias_dropout_add(out, bias, x, p, self.training, drop)
        if not dropping:
            return self.fused_bias_dropout_add(out, bias, x)
        layer = self.layer_number
        keep = dropout_masks.hidden_keep_mask(tuple(out.shape), p, layer, site, out.device)
        return self.fused_bias_dropout_add(out, bias, x, keep, 1.0 / (1.0 - p))
