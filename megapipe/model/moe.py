"""The mixture-of-experts MLP: router -> dispatch -> experts -> weighted combine (+ a shared
expert), used in place of the dense MLP on the layers --moe-layer-freq selects.

The three steps are separate so that expert parallelism can replace the local dispatch by an
all-to-all without touching the router or the experts: `DispatchPlan` says which (token,
expert) assignments exist, grouped by global expert id; `Experts` computes rows grouped that
way; `combine` adds each row, weighted by its routing probability, back to its token. A
dropped assignment (over capacity) is simply absent: its token gets nothing from that expert
and passes through the residual only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.config import ModelConfig
from megapipe.model.mlp import MLP
from megapipe.model.moe_experts import Experts
from megapipe.model.moe_losses import MoELosses
from megapipe.model.moe_router import Router
from megapipe.parallel.state import Group


@dataclass(frozen=True)
class DispatchPlan:
    """The assignments of one micro-batch, grouped by expert (tokens in order within one):
    row r goes to expert `expert_index[r]` from token `token_index[r]`; counts[e] rows each."""

    token_index: torch.Tensor
    expert_index: torch.Tensor
    counts: list[int]

    @classmethod
    def of(cls, routing_map: torch.Tensor) -> DispatchPlan:
        """From the routing map [T, E] (bool)."""
        expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
        return cls(token_index, expert_index, routing_map.sum(dim=0).tolist())

    def permute(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, h] -> the rows the experts get [assignments, h]."""
        return tokens[self.token_index]

    def combine(self, rows: torch.Tensor, probs: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """sum over each token's rows of probability x expert output -> [T, h]."""
        weights = probs[self.token_index, self.expert_index].to(rows.dtype).unsqueeze(-1)
        out = rows.new_zeros((num_tokens, rows.shape[1]))
        return out.index_add(0, self.token_index, rows * weights)


class MoELayer(torch.nn.Module):
    """Router, experts (TP-split like the dense MLP) and an optional shared expert.

    Takes and returns activations [s, b, h] complete on every TP rank (no sequence
    parallelism); returns (output, None) like the dense MLP (biases are inside)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        *,
        output_init_std: float,
        layer_number: int = 0,
        losses: MoELosses | None = None,
    ) -> None:
        super().__init__()
        moe = config.moe
        self.losses = losses or MoELosses(config.num_layers)
        self.router = Router(moe, config.hidden_size, config.init_method_std, self.losses)
        self.router.layer_number = layer_number
        self.experts = Experts(
            config,
            tp,
            moe.num_experts,
            config.moe_ffn_hidden_size,
            output_init_std=output_init_std,
            grouped_gemm=moe.moe_grouped_gemm,
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
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        probs, routing_map = self.router(tokens, s, b)
        plan = DispatchPlan.of(routing_map)
        rows = self.experts(plan.permute(tokens), plan.counts)
        out = plan.combine(rows, probs, s * b).view(s, b, h)
        if self.shared_experts is not None:
            shared, bias = self.shared_experts(x)
            out = out + (shared if bias is None else shared + bias)
        return out, None


def update_expert_biases(chunks: Sequence[torch.nn.Module], dp: Group) -> None:
    """After a training step: each router with an expert bias moves it toward balance from the
    tokens its experts got over the step, summed over DP (collective over DP: every rank of a
    DP group holds the same layers). TP ranks count the same whole tokens already."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Router) and module.expert_bias is not None:
                counts = module.tokens_per_expert.clone()
                if dp.size > 1:
                    dist.all_reduce(counts, group=dp.pg)
                module.update_expert_bias(counts)
