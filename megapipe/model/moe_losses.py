"""The MoE auxiliary losses' way into the gradient and into the log line.

As Megatron-Core, an auxiliary loss (load balancing, z-loss) is not added to the LM loss that
the pipeline's last stage returns: it is attached to an activation of its own layer
(`attach`), whose backward adds d(aux)/d(.) scaled like the LM loss's backward (loss scale /
micro-batches). So it crosses pipeline stages with no extra plumbing, and the reported LM
loss stays the LM loss. The values (without their coefficient, as Megatron logs them) are
recorded per layer in `MoELosses`, which the model owns (no global tracker), and averaged
over micro-batches, MoE layers and data-parallel ranks by `reduce_moe_losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megapipe.parallel.state import ParallelState

LOAD_BALANCING_LOSS = "load_balancing_loss"
SEQ_LOAD_BALANCING_LOSS = "seq_load_balancing_loss"
Z_LOSS = "z_loss"


def balancing_loss_name(load_balancing_type: str) -> str:
    """The name Megatron-Core logs a balancing loss by: `load_balancing_loss` (aux_loss),
    `seq_load_balancing_loss` (seq_aux_loss)."""
    return SEQ_LOAD_BALANCING_LOSS if load_balancing_type == "seq_aux_loss" else LOAD_BALANCING_LOSS


class MoELosses:
    """One model chunk's record of its MoE layers' auxiliary losses in the current step, and
    the scale their gradients start from (set by the training step)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.backward_scale = 1.0
        self.values: dict[str, torch.Tensor] = {}

    def start_step(self, backward_scale: float) -> None:
        """Forget the last step's values; aux-loss gradients start from `backward_scale`."""
        self.backward_scale = backward_scale
        self.values = {}

    def record(self, name: str, layer: int, value: torch.Tensor) -> None:
        """Add one micro-batch's loss (without its coefficient) of global layer `layer`."""
        row = self.values.get(name)
        if row is None:  # on the loss's device: no host sync per micro-batch
            row = torch.zeros(self.num_layers, dtype=torch.float64, device=value.device)
            self.values[name] = row
        row[layer] += value.detach().to(torch.float64)


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient, and `losses.backward_scale` for aux."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, losses: MoELosses) -> torch.Tensor:
        ctx.losses = losses
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scale = torch.full(ctx.aux_shape, ctx.losses.backward_scale, dtype=ctx.aux_dtype)
        return grad, scale.to(grad.device), None


def attach(x: torch.Tensor, aux: torch.Tensor, losses: MoELosses) -> torch.Tensor:
    """x, with `aux` added to the training objective through x's backward."""
    return _AttachAuxLoss.apply(x, aux, losses)


def reduce_moe_losses(
    chunks: Sequence[torch.nn.Module], state: ParallelState, num_microbatches: int
) -> dict[str, float]:
    """Each auxiliary loss of the step: summed over micro-batches and MoE layers, divided by
    micro-batches x MoE layers, averaged over DP x CP (collective over PP and DP x CP: every
    rank calls it). Empty for a dense model."""
    config = getattr(chunks[0], "config", None)
    moe = getattr(config, "moe", None)
    if moe is None:
        return {}
    names = []
    if moe.moe_router_load_balancing_type != "none" and moe.moe_aux_loss_coeff > 0:
        names.append(balancing_loss_name(moe.moe_router_load_balancing_type))
    if moe.moe_z_loss_coeff:
        names.append(Z_LOSS)
    if not names:
        return {}
    table = torch.zeros(len(names), config.num_layers, dtype=torch.float64, device=state.device)
    for chunk in chunks:
        losses = getattr(chunk, "moe_losses", None)
        for i, name in enumerate(names):
            if losses is not None and name in losses.values:
                table[i] += losses.values[name].to(state.device)
    if state.pp.size > 1:
        dist.all_reduce(table, group=state.pp.pg)
    if state.dp_cp.size > 1:  # CP ranks' losses average to their micro-batch's (moe_router)
        dist.all_reduce(table, group=state.dp_cp.pg)
        table /= state.dp_cp.size
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    sums = table.sum(dim=1).cpu() / (num_microbatches * moe_layers)
    return {name: float(value) for name, value in zip(names, sums)}
