"""Make every rank's gradients final before the optimizer step.

Two reductions happen here, once per step after the last micro-batch's backward:
* sequence-parallel replicas (norm weights, row-parallel biases) saw only this rank's sequence
  shard, so their gradients are summed over the TP group;
* gradients are averaged over the data-parallel group (one coalesced all-reduce; the bucketed,
  backward-overlapped version replaces this with the data-parallel work).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megapipe.parallel.state import Group, ParallelState


def _all_reduce_coalesced(grads: list[torch.Tensor], group: Group, scale: float = 1.0) -> None:
    if not grads or group.size == 1:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group.pg)
    if scale != 1.0:
        flat.mul_(scale)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def finalize_model_grads(params: Iterable[torch.nn.Parameter], state: ParallelState) -> None:
    """Sum sequence-parallel grads over TP, then average all grads over DP (in place)."""
    with_grad = [p for p in params if p.grad is not None]
    sequence_parallel = [
        p.grad
        for p in with_grad
        if getattr(p, "meta", None) is not None and p.meta.sequence_parallel
    ]
    _all_reduce_coalesced(sequence_parallel, state.tp)
    _all_reduce_coalesced([p.grad for p in with_grad], state.dp, 1.0 / state.dp.size)
