"""The autograd Function behind both TP linear layers: it owns the backward.

y = x W^T (+ b), where the input enters the tensor-parallel region in one of three ways:

| input_comm   | forward                   | saved for backward   | backward                     |
|--------------|---------------------------|----------------------|------------------------------|
| "none"       | -                         | x                    | -                            |
| "all_reduce" | - (Megatron's f)          | x                    | all-reduce dx, overlapping dW|
| "sequence"   | all-gather x along dim 0  | this rank's shard of | all-gather x again,          |
|              | (sequence parallelism)    | x: [s/t, b, h], not  | overlapping dx; then         |
|              |                           | the gathered [s,b,h] | reduce-scatter dx,           |
|              |                           |                      | overlapping dW               |

Column-parallel linears use "all_reduce" (or "sequence" under SP), row-parallel ones "none"
(their output reduction stays in `parallel/mappings.py`). This is Megatron-LM's
LinearWithGradAccumulationAndAsyncCommunication behaviour: under sequence parallelism autograd
keeps the local shard instead of the gathered sequence (t times less), at the price of one more
all-gather in backward, which runs while the input gradient is computed.

Weight (and bias) gradients go through `layers/weight_grad.py`: into the grad buffer's fp32
`main_grad` when one owns the weight (the GEMM in the weight's dtype, bf16 or fp16, summed in
fp32: kernels/weight_grad_gemm.py), else back to autograd; inside
`WeightGradStore.deferring()` they are queued instead (the sequence is then gathered again when
they are computed, not in backward, so deferring adds no collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from megapipe.layers.weight_grad import WeightGradStore, deliver_weight_grad
from megapipe.parallel.mappings import (
    all_gather_along,
    start_all_gather_sequence,
    start_all_reduce,
    start_reduce_scatter_sequence,
)
from megapipe.parallel.state import Group

InputComm = Literal["none", "all_reduce", "sequence"]


@dataclass(frozen=True, eq=False)
class _Call:
    """What one application needs in backward besides its saved input."""

    weight: torch.nn.Parameter
    bias: torch.nn.Parameter | None
    group: Group
    input_comm: InputComm
    store: WeightGradStore | None
    overlap: bool = True  # False: wait for each collective at once (for measuring the overlap)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _weight_grads(
    call: _Call, saved_input: torch.Tensor, grad_output: torch.Tensor, full_input, in_backward
):
    """Deliver dW = dy^T x (and db = sum dy); return what autograd gets for W and b."""
    if full_input is None:  # deferred under SP: gather the sequence now
        full_input = all_gather_along(saved_input, 0, call.group)
    grad_output = _flat(grad_output)
    grad_weight = grad_bias = None
    if call.weight.requires_grad:
        grad_weight = deliver_weight_grad(
            call.weight, factors=(grad_output, _flat(full_input)), in_backward=in_backward
        )
    if call.bias is not None and call.bias.requires_grad:
        grad_bias = deliver_weight_grad(call.bias, grad_output.sum(0), in_backward=in_backward)
    return grad_weight, grad_bias


@dataclass(frozen=True)
class _Done:
    """A collective already waited for (no overlap): `wait` returns its result."""

    result: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.result


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, call: _Call):
        full = all_gather_along(x, 0, call.group) if call.input_comm == "sequence" else x
        ctx.call = call
        ctx.save_for_backward(x)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_tensors
        call: _Call = ctx.call
        wants_input = ctx.needs_input_grad[0]
        wants_weights = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        defer = wants_weights and call.store is not None and call.store.is_deferring
        sequence = call.input_comm == "sequence"
        gather = None
        if sequence and wants_weights and not defer:
            gather = start_all_gather_sequence(x, call.group)  # for dW, while dx is computed
            if not call.overlap:
                gather = _Done(gather.wait())
        reduction = grad_input = None
        if wants_input:
            grad_input = grad_output.matmul(call.weight)
            if sequence:
                if gather is not None:
                    gather.wait()  # one collective in flight per group at a time
                reduction = start_reduce_scatter_sequence(grad_input, call.group)
            elif call.input_comm == "all_reduce":
                reduction = start_all_reduce(grad_input, call.group)
            if reduction is not None and not call.overlap:
                reduction = _Done(reduction.wait())
        grad_weight = grad_bias = None
        if defer:
            params = [p for p in (call.weight, call.bias) if p is not None and p.requires_grad]
            full = None if sequence else x

            def compute(in_backward: bool) -> tuple:
                return _weight_grads(call, x, grad_output, full, in_backward)

            call.store.defer(compute, params)
        elif wants_weights:
            full = gather.wait() if gather is not None else x
            grad_weight, grad_bias = _weight_grads(call, x, grad_output, full, True)
        if reduction is not None:
            grad_input = reduction.wait()
        return grad_input, grad_weight, grad_bias, None


def tensor_parallel_linear(
    x: torch.Tensor,
    weight: torch.nn.Parameter,
    bias: torch.nn.Parameter | None,
    group: Group,
    *,
    input_comm: InputComm,
    store: WeightGradStore | None = None,
    overlap: bool = True,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with the input entering the TP region by `input_comm`.

    store: where the layer defers its weight gradients inside `store.deferring()`.
    overlap: False waits for each backward collective as soon as it is started instead of
    computing the next matmul meanwhile (Megatron's --no-async-tensor-model-parallel-allreduce).
    """
    if group.size == 1:
        input_comm = "none"
    return _TensorParallelLinear.apply(
        x, weight, bias, _Call(weight, bias, group, input_comm, store, overlap)
    )
