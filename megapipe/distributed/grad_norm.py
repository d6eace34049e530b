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


def counted_in_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank counts `param` in the norm (each logical element exactly once)."""
    meta = getattr(param, "meta", None)
    if meta is None:
        return tp_rank == 0
    if meta.copy_of is not None:  # the last stage's tied-embedding copy: counted at the source
        return False
    return meta.is_tensor_parallel or tp_rank == 0


def gradient(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The gradient the optimizer uses: the fp32 `main_grad` when a GradBuffer owns the param."""
    return getattr(param, "main_grad", param.grad)


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ x² over all entries, accumulated in float64 without float64 copies of the tensors.

    6.7 ms instead of 18.2 ms for t.double().pow(2).sum() over 4.2 M gradients, and as exact;
    torch's fp32 norm was 5.9e-6 off there (benchmarks/RESULTS.md, bench_data_parallel.py),
    enough to break norm parity between layouts.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float64)
    return torch.stack(norms).square().sum().to(device)


def global_grad_norm(params: Iterable[torch.nn.Parameter], state: ParallelState) -> float:
    """sqrt(sum of squared gradient entries of the full model), same value on every rank."""
    grads = [
        gradient(p) for p in params if gradient(p) is not None and counted_in_norm(p, state.tp.rank)
    ]
    total = sum_of_squares(grads, state.device)
    if state.model_parallel.size > 1:
        dist.all_reduce(total, group=state.model_parallel.pg)
    return float(total.sqrt())
