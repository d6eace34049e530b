"""The L2 norm of the whole model's gradient, whatever the layout.

TP shards are summed over the TP group, TP replicas (norms, row-parallel biases) counted once,
pipeline stages summed, and a mirrored parameter (the last stage's copy of a tied embedding)
counted only where the original lives. So the norm equals the single-rank model's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megapipe.parallel.state import ParallelState


def global_grad_norm(params: Iterable[torch.nn.Parameter], state: ParallelState) -> float:
    """sqrt(sum of squared gradient entries of the full model), same value on every rank."""
    total = torch.zeros((), dtype=torch.float64, device=state.device)
    for p in params:
        if p.grad is None:
            continue
        meta = getattr(p, "meta", None)
        if meta is not None and meta.copy_of is not None:
            continue
        replicated = meta is None or not meta.is_tensor_parallel
        if replicated and state.tp.rank != 0:
            continue
        total += p.grad.detach().double().pow(2).sum()
    if state.model_parallel.size > 1:
        dist.all_reduce(total, group=state.model_parallel.pg)
    return float(total.sqrt())
