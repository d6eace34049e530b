"""The MoE router: a linear hidden -> experts in fp32, top-k selection, capacity dropping and
the load-balancing losses, with Megatron-Core's semantics (`topk_softmax_with_capacity`,
`switch_load_balancing_loss_func`, `sequence_load_balancing_loss_func`, `z_loss_func`).

Routing (softmax, the default): top-k of the logits, then a softmax over the k chosen (Mixtral);
with pre-softmax: a softmax over all experts, then top-k (not renormalised). Sigmoid: top-k of
sigmoid(logits) (plus the expert bias, for selection only), normalised over the k chosen when
k > 1. The scaling factor multiplies the chosen probabilities. Every decision depends only on
the micro-batch's tokens, in their logical order [s, b] flattened s-major, never on the layout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapipe.config import MoEConfig
from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.model.moe_losses import Z_LOSS, MoELosses, attach, balancing_loss_name
from megapipe.parallel.state import Group


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], zero off the chosen experts; routing_map [T, E] bool) from fp32 logits."""
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1)
            probs, chosen = torch.topk(scores, topk, dim=-1)
        else:
            top, chosen = torch.topk(logits, topk, dim=-1)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        selection = scores if expert_bias is None else scores + expert_bias
        _, chosen = torch.topk(selection, topk, dim=-1)
        probs = torch.gather(scores, 1, chosen)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
    return torch.zeros_like(logits).scatter(1, chosen, probs), routing_map


def expert_capacity(num_tokens: int, num_experts: int, topk: int, factor: float) -> int:
    """Tokens one expert takes from a micro-batch: ceil(tokens x topk / experts x factor)."""
    return math.ceil(num_tokens * topk / num_experts * factor)


def drop_over_capacity(
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    capacity: int,
    policy: str,
    pad_to_capacity: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert: the highest-probability ones (probs) or the
    earliest (position); ties go to the earlier token. With pad_to_capacity every expert gets
    exactly `capacity` rows (chosen alike; an unrouted row has probability 0)."""
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        key = probs if policy == "probs" else routing_map.to(probs.dtype)
        order = torch.sort(key, dim=0, descending=True, stable=True).indices[:capacity]
        keep = torch.zeros_like(routing_map).scatter(0, order, True)
    kept = keep if pad_to_capacity else routing_map & keep
    return probs * kept, kept


def aux_loss_scores(
    logits: torch.Tensor, topk: int, score_function: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E] over all experts, their top-k map): what the balancing losses see."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    chosen = torch.topk(scores, topk, dim=-1).indices
    return scores, torch.zeros_like(scores, dtype=torch.bool).scatter(1, chosen, True)


def _summed(counts: torch.Tensor, cp: Group | None) -> tuple[torch.Tensor, int]:
    """Routing counts summed over the context-parallel group (a whole sequence's), and the
    group's size (1 without CP)."""
    if cp is None or cp.size == 1:
        return counts, 1
    counts = counts.clone()
    dist.all_reduce(counts, group=cp.pg)
    return counts, cp.size


def switch_load_balancing_loss(
    scores: torch.Tensor, routing_map: torch.Tensor, topk: int, cp: Group | None = None
) -> torch.Tensor:
    """E x sum_i f_i P_i: f_i = tokens routed to i / (T x topk), P_i = mean score of i.

    Under context parallelism (`cp`) f counts the whole micro-batch (summed over CP) and P
    this rank's tokens: the CP ranks' losses then average to the whole micro-batch's loss, and
    each rank's gradient is CP x its tokens' share, which the gradients' average over DP x CP
    turns into the one-rank gradient (the LM loss's convention)."""
    num_tokens, num_experts = scores.shape
    counts, parts = _summed(routing_map.sum(dim=0).to(scores.dtype), cp)
    f = counts / (num_tokens * parts * topk)
    return num_experts * torch.sum(f * scores.mean(dim=0))


def sequence_load_balancing_loss(
    scores: torch.Tensor,
    routing_map: torch.Tensor,
    topk: int,
    seq_length: int,
    batch: int,
    cp: Group | None = None,
) -> torch.Tensor:
    """The switch loss of each sequence alone, averaged over the micro-batch's sequences
    (`seq_length`: this rank's part under CP, whose counts are summed over `cp` as above)."""
    num_experts = scores.shape[1]
    scores = scores.view(seq_length, batch, num_experts)
    counts = routing_map.view(seq_length, batch, num_experts).sum(dim=0).to(scores.dtype)
    counts, parts = _summed(counts, cp)
    f = counts / (seq_length * parts * topk)
    return (num_experts * f * scores.mean(dim=0)).sum(dim=1).mean()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return torch.square(torch.logsumexp(logits, dim=-1)).mean()


class Router(torch.nn.Module):
    """weight [experts, hidden] (no bias), replicated over TP. expert_bias (sigmoid routing
    with --moe-router-enable-expert-bias) is no parameter: `update_expert_bias` moves it after
    each step from the tokens each expert got (`tokens_per_expert`, counted in training)."""

    def __init__(
        self,
        config: MoEConfig,
        hidden_size: int,
        init_std: float,
        losses: MoELosses,
        cp: Group | None = None,
    ) -> None:
        """cp: the context-parallel group, over which the balancing losses count routing."""
        super().__init__()
        self.config = config
        self.cp = cp
        self.losses = losses
        self.layer_number = 0  # set by the MoE layer (keys the recorded losses)
        e = config.num_experts
        self.weight = make_param(ParamMeta((e, hidden_size), init_std=init_std), 1)
        enabled = config.moe_router_enable_expert_bias
        self.register_buffer("expert_bias", torch.zeros(e) if enabled else None, persistent=False)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(e) if enabled else None, persistent=False
        )

    def forward(
        self, tokens: torch.Tensor, seq_length: int, batch: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T = s x b, h] -> (probs [T, E] fp32, routing_map [T, E] bool)."""
        config = self.config
        logits = F.linear(tokens.float(), self.weight.float())  # fp32, as Megatron-Core
        training = self.training and torch.is_grad_enabled()
        if training and config.moe_z_loss_coeff:
            loss = z_loss(logits)
            logits = attach(logits, loss * config.moe_z_loss_coeff, self.losses)
            self.losses.record(Z_LOSS, self.layer_number, loss)
        k = config.moe_router_topk
        probs, routing_map = topk_routing(
            logits,
            k,
            config.moe_router_score_function,
            config.moe_router_pre_softmax,
            config.moe_router_topk_scaling_factor,
            self.expert_bias,
        )
        if config.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(
                logits.shape[0], config.num_experts, k, config.moe_expert_capacity_factor
            )
            probs, routing_map = drop_over_capacity(
                probs,
                routing_map,
                capacity,
                config.moe_token_drop_policy,
                config.moe_pad_expert_input_to_capacity,
            )
        balancing = config.moe_router_load_balancing_type
        if training and balancing != "none" and config.moe_aux_loss_coeff > 0:
            scores, loss_map = aux_loss_scores(logits, k, config.moe_router_score_function)
            if balancing == "aux_loss":
                loss = switch_load_balancing_loss(scores, loss_map, k, self.cp)
            else:
                loss = sequence_load_balancing_loss(scores, loss_map, k, seq_length, batch, self.cp)
            probs = attach(probs, loss * config.moe_aux_loss_coeff, self.losses)
            self.losses.record(balancing_loss_name(balancing), self.layer_number, loss)
        if training and self.expert_bias is not None:
            self.tokens_per_expert += routing_map.sum(dim=0).to(self.tokens_per_expert.dtype)
        return probs, routing_map

    def _apply(self, fn, recurse: bool = True):
        """Moves follow the module; the expert bias and its counts stay fp32 under a bf16/fp16
        model, as Megatron-Core keeps them (steps of 1e-3 vanish in bf16 near 1)."""
        super()._apply(fn, recurse)
        for name in ("expert_bias", "tokens_per_expert"):
            value = getattr(self, name)
            if value is not None and value.dtype != torch.float32:
                setattr(self, name, value.float())
        return self

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's step: bias += rate x sign(mean count - count); counts restart."""
        offset = counts.mean() - counts
        self.expert_bias += torch.sign(offset) * self.config.moe_router_bias_update_rate
        self.tokens_per_expert.zero_()
