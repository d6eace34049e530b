"""Column- and row-parallel linear layers (Megatron-LM's tensor-parallel MLP/attention halves).

ColumnParallelLinear splits the output features across TP ranks (Y = X [A_1 .. A_t]); its input
enters the TP region as Megatron's f (all-reduce of the input gradient) or, with sequence
parallelism, through an all-gather of the sequence. RowParallelLinear splits the input
features (Y = sum_i X_i A_i) and leaves the region with an all-reduce, or a reduce-scatter of the
sequence under sequence parallelism. Both return `(output, bias)`; bias is None unless
`skip_bias_add`, which hands the bias to the caller for a fused bias-dropout-add.

Both run their matmul through one autograd Function (`layers/linear_function.py`) that owns the
backward: the column-parallel input's collectives, the saved input (the local sequence shard
under SP) and the weight gradient, which goes straight into the grad buffer's fp32 `main_grad`
when one owns the weight (or is deferred, `layers/weight_grad.py`). Their weights, and the
biases added inside the Function, are claimed: their gradients never pass through autograd's
accumulation when a grad buffer is attached. A row-parallel bias added after the reduction is an
ordinary autograd parameter.
"""

from __future__ import annotations

import torch

from megapipe.layers.linear_function import tensor_parallel_linear
from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.layers.weight_grad import WeightGradStore, claim_weight_grad
from megapipe.parallel.mappings import (
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from megapipe.parallel.state import Group


class ColumnParallelLinear(torch.nn.Module):
    """Y = XA + b with A split along its output features across the TP group.

    weight: pass an existing [out/tp, in] parameter (the tied word embedding) instead of
    creating one. stride: the weight is `stride` stacked blocks each split across ranks.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group: Group,
        *,
        init_std: float,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        stride: int = 1,
        weight: torch.nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        if weight is None:
            self.weight = make_param(
                ParamMeta((output_size, input_size), tp_dim=0, tp_stride=stride, init_std=init_std),
                tp_group.size,
            )
        else:
            self.weight = weight
            if weight.shape != (output_size // tp_group.size, input_size):
                raise ValueError(
                    f"shared weight has shape {tuple(weight.shape)}, expected "
                    f"{(output_size // tp_group.size, input_size)}"
                )
        self.bias = (
            make_param(ParamMeta((output_size,), tp_dim=0, tp_stride=stride), tp_group.size)
            if bias
            else None
        )
        claim_weight_grad(self.weight)
        if self.bias is not None and not skip_bias_add:
            claim_weight_grad(self.bias)
        self.weight_grad_store: WeightGradStore | None = None  # set by WeightGradStore.attach
        self.overlap_comm = True  # set by set_tp_comm_overlap

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = tensor_parallel_linear(
            x,
            self.weight,
            None if self.skip_bias_add else self.bias,
            self.tp_group,
            input_comm="sequence" if self.sequence_parallel else "all_reduce",
            store=self.weight_grad_store,
            overlap=self.overlap_comm,
        )
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """Y = XA + b with A split along its input features across the TP group.

    input_is_parallel: X is already split along its last dimension (the output of a
    ColumnParallelLinear); otherwise it is scattered first. The bias is added once, after the
    reduction, so it is replicated (and partial-gradient under sequence parallelism).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp_group: Group,
        *,
        init_std: float,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and tp_group.size > 1
        self.weight = make_param(
            ParamMeta((output_size, input_size), tp_dim=1, init_std=init_std), tp_group.size
        )
        self.bias = (
            make_param(
                ParamMeta((output_size,), sequence_parallel=self.sequence_parallel), tp_group.size
            )
            if bias
            else None
        )
        # On one rank the bias is added inside the matmul (one fused op), so claimed there.
        self.fused_bias = tp_group.size == 1 and not skip_bias_add
        claim_weight_grad(self.weight)
        if self.bias is not None and self.fused_bias:
            claim_weight_grad(self.bias)
        self.weight_grad_store: WeightGradStore | None = None  # set by WeightGradStore.attach

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)
        bias = self.bias if self.fused_bias else None
        y = tensor_parallel_linear(
            x, self.weight, bias, self.tp_group, input_comm="none", store=self.weight_grad_store
        )
        if self.fused_bias:
            return y, None
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return (y + self.bias if self.bias is not None else y), None


def set_tp_comm_overlap(module: torch.nn.Module, overlap: bool) -> None:
    """Whether the column-parallel linears in `module` overlap their backward collectives
    (the input-gradient all-reduce or reduce-scatter, SP's re-gather) with the next matmul."""
    for layer in module.modules():
        if isinstance(layer, ColumnParallelLinear):
            layer.overlap_comm = overlap
