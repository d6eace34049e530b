"""One training iteration: the pipeline schedule over all micro-batches, then one optimizer step.

The schedule's executor runs every micro-batch's forward and backward (with PP=1 it is plain
gradient accumulation); gradient buckets are reduced over DP during or after it. Each
micro-batch's mean token loss is divided by the number of micro-batches before its backward,
so the accumulated gradient is that of the mean over the rank's share of the global batch;
averaging over DP and finalize_model_grads (sequence-parallel and tied-embedding sums) then
give the gradient of the global batch's mean loss whatever the layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megapipe.config import Configs
from megapipe.data.batch import TrainingBatch
from megapipe.data.sampler import micro_batch_range
from megapipe.distributed import finalize_model_grads
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.trace import TraceRecorder


class BatchSource(Protocol):
    """Anything that turns global sample indices into a batch (the mock dataset, for now)."""

    def batch(self, indices: range) -> TrainingBatch: ...


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports: the global batch's mean loss and the gradient norm."""

    lm_loss: float
    grad_norm: float
    skipped: bool = False


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf (fp32/bf16): training stops before the weights are touched."""


def train_step(
    chunks: Sequence[torch.nn.Module],
    optimizer: ShardedOptimizer,
    executor: PipelineExecutor,
    data: BatchSource,
    configs: Configs,
    state: ParallelState,
    iteration: int,
    lr: float,
    trace: TraceRecorder | None = None,
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

    scaler = optimizer.scaler
    losses = executor.run(
        get_batch, loss_scale=scaler.scale if scaler is not None else 1.0, trace=trace
    )
    for buffer in optimizer.buffers:
        buffer.finish_grad_sync()
    finalize_model_grads(chunks, state)
    lm_loss = _global_mean_loss(losses, state)
    if scaler is None and not math.isfinite(lm_loss):
        raise NonFiniteLossError(
            f"iteration {iteration + 1}: lm loss is {lm_loss}; stopping before the optimizer "
            "step, so the weights are those of the previous iteration"
        )
    outcome = optimizer.step(lr)
    optimizer.zero_grad()
    return StepResult(lm_loss=lm_loss, grad_norm=outcome.grad_norm, skipped=outcome.skipped)


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
