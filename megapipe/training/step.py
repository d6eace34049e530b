"""One training iteration: the pipeline schedule over all micro-batches, then one optimizer step.

The schedule's executor runs every micro-batch's forward and backward (with PP=1 it is plain
gradient accumulation). Each micro-batch's mean token loss is divided by the number of
micro-batches before its backward, so the accumulated gradient is that of the mean over the
rank's share of the global batch; finalize_model_grads then sums sequence-parallel and tied-
embedding gradients and averages over data-parallel ranks, giving the gradient of the global
batch's mean loss whatever the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megapipe.config import Configs
from megapipe.data.mock import TrainingBatch
from megapipe.data.sampler import micro_batch_range
from megapipe.distributed import finalize_model_grads, global_grad_norm
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor


class BatchSource(Protocol):
    """Anything that turns global sample indices into a batch (the mock dataset, for now)."""

    def batch(self, indices: range) -> TrainingBatch: ...


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports: the global batch's mean loss and the gradient norm."""

    lm_loss: float
    grad_norm: float
    skipped: bool = False


def train_step(
    chunks: Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    executor: PipelineExecutor,
    data: BatchSource,
    configs: Configs,
    state: ParallelState,
    iteration: int,
) -> StepResult:
    """Run iteration `iteration` (0-based) on this rank's slice of its global batch."""
    training = configs.training

    def get_batch(micro_batch: int) -> TrainingBatch:
        indices = micro_batch_range(
            iteration,
            micro_batch,
            global_batch_size=training.global_batch_size,
            micro_batch_size=training.micro_batch_size,
            data_parallel_rank=state.dp.rank,
            data_parallel_size=state.dp.size,
        )
        return data.batch(indices).to(state.device)

    losses = executor.run(get_batch)
    finalize_model_grads(chunks, state)
    grad_norm = global_grad_norm([p for c in chunks for p in c.parameters()], state)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(lm_loss=_global_mean_loss(losses, state), grad_norm=grad_norm)


def _global_mean_loss(losses: list[torch.Tensor], state: ParallelState) -> float:
    """Mean over micro-batches and DP ranks, computed on the last stage, known on every rank."""
    mean = torch.zeros((), dtype=torch.float32, device=state.device)
    if state.is_last_stage:
        mean = torch.stack(losses).float().mean()
        if state.dp.size > 1:
            dist.all_reduce(mean, group=state.dp.pg)
            mean /= state.dp.size
    if state.pp.size > 1:
        dist.broadcast(mean, src=state.pp.ranks[-1], group=state.pp.pg)
    return float(mean)
