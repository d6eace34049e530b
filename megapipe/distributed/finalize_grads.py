"""Make every rank's gradients final before the optimizer step.

Three reductions happen here, once per step after the last micro-batch's backward:
* sequence-parallel replicas (norm weights, row-parallel biases) saw only this rank's sequence
  shard, so their gradients are summed over the TP group;
* with tied input/output embeddings split over pipeline stages, the first stage's word
  embedding and the last stage's copy each hold part of the gradient: summed over the
  embedding group, so both copies take the same optimizer step and stay identical;
* gradients are averaged over the data-parallel group, DP x CP with context parallelism
  (`ParallelState.dp_cp`: CP ranks hold the same parameters, and each CP rank's loss is scaled
  by CP, so the average over DP x CP is the whole sequence's gradient; one coalesced
  all-reduce; the bucketed, backward-overlapped version replaces this with the data-parallel
  work).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from megapipe.distributed.grad_norm import gradient
from megapipe.layers.param_meta import is_expert
from megapipe.parallel.state import Group, ParallelState


def _all_reduce_coalesced(
    grads: list[torch.Tensor], group: Group | None, scale: float = 1.0
) -> None:
    if not grads or group is None or (group.size == 1 and scale == 1.0):
        return
    flat = _flatten_dense_tensors(grads)
    if group.size > 1:
        dist.all_reduce(flat, group=group.pg)
    if scale != 1.0:
        flat.mul_(scale)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def tied_embedding_grads(chunks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """Gradients of the tied word-embedding copies this rank holds (first/last stage)."""
    shared = (getattr(chunk, "shared_word_embedding", lambda: None)() for chunk in chunks)
    return [gradient(p) for p in shared if p is not None and gradient(p) is not None]


def finalize_model_grads(chunks: Sequence[torch.nn.Module], state: ParallelState) -> None:
    """Sum SP grads over TP, tied-embedding grads over the embedding group, average over DP
    (x CP: `state.dp_cp`).

    Parameters owned by a GradBuffer (`main_grad`) are averaged over DP x CP by its buckets
    (`finish_grad_sync`, called before this), and FSDP2's (DTensor gradients) by its
    reduce-scatter; only plain `.grad` parameters are averaged here. The TP and embedding sums
    run on FSDP2's local shards alike: both sides hold the same rows of the same parameter.
    """
    reduce_tp, reduce_dp = state.tp.size > 1, state.dp_cp.size > 1
    params = []  # walked only when a group has more than one rank (0.26 ms a step at 1 rank)
    if reduce_tp or reduce_dp:
        params = [p for chunk in chunks for p in chunk.parameters() if gradient(p) is not None]
    if reduce_tp:
        sequence_parallel = [
            gradient(p)
            for p in params
            if getattr(p, "meta", None) is not None and p.meta.sequence_parallel
        ]
        _all_reduce_coalesced(sequence_parallel, state.tp)
    if state.pp.size > 1:
        _all_reduce_coalesced(tied_embedding_grads(chunks), state.embedding)
    if reduce_dp:
        plain = [
            p for p in params if not hasattr(p, "main_grad") and not isinstance(p.grad, DTensor)
        ]
        experts = [p.grad for p in plain if state.ep.size > 1 and is_expert(p)]
        dense = [p.grad for p in plain if not (state.ep.size > 1 and is_expert(p))]
        _all_reduce_coalesced(dense, state.dp_cp, 1.0 / state.dp_cp.size)
        # experts: summed where the same ones live, divided by DP x CP all the same (their
        # gradients already hold every EP rank's tokens' contributions)
        _all_reduce_coalesced(experts, state.expert_dp, 1.0 / state.dp_cp.size)
