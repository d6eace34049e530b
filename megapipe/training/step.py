"""One training iteration: gradient accumulation over micro-batches, then one optimizer step.

Each micro-batch's mean token loss is divided by the number of micro-batches before its
backward, so the accumulated gradient is that of the mean over the rank's share of the global
batch; finalize_model_grads then averages it over data-parallel ranks, giving the gradient of
the global batch's mean loss whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megapipe.config import Configs
from megapipe.data.mock import TrainingBatch
from megapipe.data.sampler import micro_batch_range
from megapipe.distributed import finalize_model_grads, global_grad_norm
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model.gpt import GPTModel
from megapipe.parallel.state import ParallelState


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
    model: GPTModel,
    optimizer: torch.optim.Optimizer,
    data: BatchSource,
    configs: Configs,
    state: ParallelState,
    iteration: int,
) -> StepResult:
    """Run iteration `iteration` (0-based) on this rank's slice of its global batch."""
    training = configs.training
    num_microbatches = training.num_microbatches(state.dp.size)
    loss_sum = torch.zeros((), dtype=torch.float32, device=state.device)
    for micro_batch in range(num_microbatches):
        indices = micro_batch_range(
            iteration,
            micro_batch,
            global_batch_size=training.global_batch_size,
            micro_batch_size=training.micro_batch_size,
            data_parallel_rank=state.dp.rank,
            data_parallel_size=state.dp.size,
        )
        batch = data.batch(indices).to(state.device)
        per_token_loss = model(tokens=batch.tokens, labels=batch.labels)
        loss = masked_mean(per_token_loss, batch.loss_mask)
        (loss / num_microbatches).backward()
        loss_sum += loss.detach().float()

    params = list(model.parameters())
    finalize_model_grads(params, state)
    grad_norm = global_grad_norm(params, state)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    mean_loss = loss_sum / num_microbatches
    if state.dp.size > 1:
        dist.all_reduce(mean_loss, group=state.dp.pg)
        mean_loss /= state.dp.size
    return StepResult(lm_loss=float(mean_loss), grad_norm=grad_norm)
