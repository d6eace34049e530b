"""The mixture-of-experts MLP: router -> dispatch -> experts -> weighted combine (+ a shared
expert), used in place of the dense MLP on the layers --moe-layer-freq selects.

The steps are separate so that expert parallelism only changes the dispatch
(`model/moe_dispatch.py`: the local sort, or Megatron's alltoall and allgather dispatchers over
the EP group), never the router or the experts. A dropped assignment (over capacity) is simply
absent: its token gets nothing from that expert and passes through the residual only.

Under sequence parallelism the layer gathers the TP group's sequence shards first (its router
and experts then see whole tokens on every TP rank, as without it) and keeps its own shard of
the output; the router's and shared expert's gradients are then whole on every TP rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.model.mlp import MLP
from megapipe.model.moe_dispatch import DispatchPlan, dispatch
from megapipe.model.moe_experts import Experts
from megapipe.model.moe_losses import MoELosses
from megapipe.model.moe_router import Router
from megapipe.parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megapipe.parallel.state import Group

__all__ = ["DispatchPlan", "MoELayer", "update_expert_biases"]


class MoELayer(torch.nn.Module):
    """Router, experts (TP-split like the dense MLP, E / EP of them on this rank) and an
    optional shared expert.

    Takes and returns activations [s, b, h] (this rank's sequence shard [s / TP, b, h] with
    sequence parallelism); returns (output, None) like the dense MLP (biases are inside)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        *,
        output_init_std: float,
        layer_number: int = 0,
        losses: MoELosses | None = None,
        ep: Group | None = None,
        sequence_parallel: bool = False,
        cp: Group | None = None,
    ) -> None:
        super().__init__()
        moe = config.moe
        self.tp, self.ep = tp, ep or Group.single()
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.dispatcher = moe.moe_token_dispatcher_type
        self.losses = losses or MoELosses(config.num_layers)
        self.router = Router(moe, config.hidden_size, config.init_method_std, self.losses, cp)
        self.router.layer_number = layer_number
        self.experts = Experts(
            config,
            tp,
            moe.num_experts,
            config.moe_ffn_hidden_size,
            output_init_std=output_init_std,
            grouped_gemm=moe.moe_grouped_gemm,
            ep=self.ep,
        )
        self.shared_experts = None
        if moe.moe_shared_expert_intermediate_size is not None:
            shared = dataclasses.replace(
                config, ffn_hidden_size=moe.moe_shared_expert_intermediate_size
            )
            self.shared_experts = MLP(
                shared, tp, output_init_std=output_init_std, sequence_parallel=False
            )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:  # whole tokens on every TP rank, whose gradients are whole
            x = gather_from_sequence_parallel_region(x, self.tp, grad_is_partial=False)
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, s, b)
        out = dispatch(self.dispatcher, tokens, probs, routing_map, self.experts, self.ep)
        out = out.view(s, b, h)
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(x)
            out = out + (shared if bias is None else shared + bias)
        if self.sequence_parallel:
            out = scatter_to_sequence_parallel_region(out, self.tp)
        return out, None


def update_expert_biases(chunks: Sequence[torch.nn.Module], dp: Group) -> None:
    """After a training step: each router with an expert bias moves it toward balance from the
    tokens its experts got over the step, summed over `dp` (DP x CP: collective there, every
    rank of it holds the same layers). TP ranks count the same whole tokens already."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Router) and module.expert_bias is not None:
                counts = module.tokens_per_expert.clone()
                if dp.size > 1:
                    dist.all_reduce(counts, group=dp.pg)
                module.update_expert_bias(counts)
