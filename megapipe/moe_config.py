"""The mixture-of-experts settings (Megatron-LM's --num-experts family), a field of
`megapipe.config.ModelConfig`; kept apart so the config module stays one screenful per concept."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the dense MLP (Megatron-LM's --num-experts family).

    moe_layer_freq: an int N puts an MoE on every N-th layer (layers 0, N, 2N, ...), a tuple
    gives one 1 (MoE) or 0 (dense) per layer, as Megatron-LM's `--moe-layer-freq`.
    """

    num_experts: int
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_ffn_hidden_size: int | None = None  # None: the dense ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_shared_expert_intermediate_size: int | None = None
    moe_grouped_gemm: bool = False
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_dispatcher_type: str = "allgather"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer index `layer` holds an MoE (else the dense MLP)."""
        if isinstance(self.moe_layer_freq, int):
            return layer % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer])
