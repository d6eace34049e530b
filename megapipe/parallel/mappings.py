"""Autograd-aware collectives: where the tensor-parallel communication happens.

Megatron's "f" and "g" operators and their sequence-parallel counterparts. Each pairs a forward
collective with its adjoint in backward:

| function                                  | forward                 | backward              |
|-------------------------------------------|-------------------------|-----------------------|
| copy_to_tp_region (f)                     | identity                | all-reduce            |
| reduce_from_tp_region (g)                 | all-reduce              | identity              |
| scatter_to_tp_region                      | split last dim          | all-gather last dim   |
| gather_from_tp_region                     | all-gather last dim     | split last dim        |
| scatter_to_sequence_parallel_region       | split dim 0 (sequence)  | all-gather dim 0      |
| gather_from_sequence_parallel_region      | all-gather dim 0        | reduce-scatter dim 0  |
| reduce_scatter_to_sequence_parallel_region| reduce-scatter dim 0    | all-gather dim 0      |
| all_to_all_rows                           | all-to-all of dim 0     | the reverse all-to-all|

Activations are [sequence, batch, hidden], so sequence-parallel shards are contiguous slices.
Every function returns its input unchanged for a group of one: TP=1 pays nothing.

The column- and row-parallel linear layers do not use f or the sequence gather: their autograd
Function (`layers/linear_function.py`) runs the same collectives itself so that it can save the
local sequence shard and overlap its backward collectives with its matmuls, through the
asynchronous `start_*` helpers below (plain tensors, no autograd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.parallel.state import Group


# torch >= 2.13 renamed the single-tensor collectives; keep working on older releases too. Looked
# up at each call, so that whatever wraps torch.distributed (a profiler, a test's counter) sees it.
def all_gather_single(out: torch.Tensor, x: torch.Tensor, *, group, async_op: bool = False):
    """Gather the group's `x` into `out` (no autograd; the layers' and buffers' raw collective)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, *, group, async_op: bool = False):
    """Sum the group's `x` and keep this rank's slice in `out` (no autograd)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum over the group into a new tensor (the input is left untouched)."""
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group.pg)
    return out


def split_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """This rank's contiguous 1/size slice of `x` along `dim`, in storage of its own: a view
    (the chunk of dim 0 is already contiguous) would keep all of `x` alive wherever the slice
    is kept, e.g. saved for backward by the first layer under sequence parallelism."""
    if x.shape[dim] % group.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not split over {group.size} ranks"
        )
    piece = x.chunk(group.size, dim=dim)[group.rank]
    return piece.clone(memory_format=torch.contiguous_format) if group.size > 1 else piece


def all_gather_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    all_gather_single(out, x, group=group.pg)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum over the group, keeping this rank's 1/size slice along `dim`."""
    if x.shape[dim] % group.size:
        raise ValueError(
            f"dimension {dim} of size {x.shape[dim]} does not reduce-scatter over "
            f"{group.size} ranks"
        )
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    reduce_scatter_single(out, x, group=group.pg)
    return out.movedim(0, dim).contiguous()


@dataclass
class Pending:
    """A collective started with async_op=True: `wait()` returns its result once it is done."""

    tensor: torch.Tensor
    work: dist.Work | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


def start_all_reduce(x: torch.Tensor, group: Group) -> Pending:
    """Start summing `x` over the group, in place (x must be contiguous and owned)."""
    if group.size == 1:
        return Pending(x)
    return Pending(x, dist.all_reduce(x, group=group.pg, async_op=True))


def start_all_gather_sequence(x: torch.Tensor, group: Group) -> Pending:
    """Start concatenating every rank's `x` along dim 0 (the sequence), in rank order."""
    if group.size == 1:
        return Pending(x)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    return Pending(out, all_gather_single(out, x, group=group.pg, async_op=True))


def start_reduce_scatter_sequence(x: torch.Tensor, group: Group) -> Pending:
    """Start summing `x` over the group, keeping this rank's slice of dim 0."""
    if group.size == 1:
        return Pending(x)
    if x.shape[0] % group.size:
        raise ValueError(
            f"dimension 0 of size {x.shape[0]} does not reduce-scatter over {group.size} ranks"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    return Pending(out, reduce_scatter_single(out, x, group=group.pg, async_op=True))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, -1, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along(grad, -1, ctx.group), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 0, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        # Consumers inside a TP region each hold a partial gradient of the full sequence: sum
        # them while scattering. Replicated consumers hold the full gradient: just split.
        if ctx.grad_is_partial:
            return reduce_scatter_along(grad, 0, ctx.group), None, None
        return split_along(grad, 0, ctx.group), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 0, ctx.group), None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, receive, group):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return exchange_rows(x, send, receive, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange_rows(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def exchange_rows(
    x: torch.Tensor, send: list[int], receive: list[int], group: Group
) -> torch.Tensor:
    """All-to-all of rows (no autograd): send[j] rows of `x`, in order, to rank j; returns the
    receive[j] rows from each rank j, in rank order."""
    x = x.contiguous()
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x, receive, send, group=group.pg)
    return out


def copy_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: enter a TP region (identity forward, all-reduce backward)."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: leave a TP region by summing partial results (all-reduce forward)."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the last dimension."""
    return x if group.size == 1 else _ScatterLastDim.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather the last dimension."""
    return x if group.size == 1 else _GatherLastDim.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's slice of the sequence (dim 0)."""
    return x if group.size == 1 else _ScatterSequence.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, grad_is_partial: bool = True
) -> torch.Tensor:
    """All-gather the sequence before a column-parallel layer (reduce-scatter in backward)."""
    return x if group.size == 1 else _GatherSequence.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence slice, after a row-parallel layer."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, group)


def all_to_all_rows(
    x: torch.Tensor, send: list[int], receive: list[int], group: Group
) -> torch.Tensor:
    """Send send[j] rows of `x` (dim 0, in order) to rank j, receive receive[j] from each
    (the MoE token exchange); backward sends the gradients back the same way reversed."""
    return x if group.size == 1 else _AllToAllRows.apply(x, send, receive, group)
