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
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from megapipe.data.batch import TrainingBatch
from megapipe.data.context_parallel_split import split_batch
from megapipe.data.sampler import micro_batch_range
from megapipe.distributed import finalize_model_grads
from megapipe.distributed.optimizer import NonFiniteGradient, ShardedOptimizer
from megapipe.errors import MegapipeError
from megapipe.model.moe import update_expert_biases
from megapipe.model.moe_losses import reduce_moe_losses
from megapipe.model.te_layers import start_microbatches
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.pipeline.trace import TraceRecorder


class BatchSource(Protocol):
    """Anything that turns global sample indices into a batch (mock or indexed datasets)."""

    def batch(self, indices: range, device: torch.device | str = "cpu") -> TrainingBatch: ...


@dataclass(frozen=True)
class StepResult:
    """What one iteration reports: the global batch's mean loss and the gradient norm.

    `timers` (seconds of this rank's forward-backward, gradient reduction and optimizer step)
    is left out of comparisons: two runs of the same numbers never take the same time.
    """

    lm_loss: float
    grad_norm: float
    skipped: bool = False
    timers: dict[str, float] = field(default_factory=dict, compare=False)
    num_zeros: float | None = None  # --log-num-zeros-in-grad (None: not asked, or skipped)
    params_norm: float | None = None  # --log-params-norm: after the update
    # MoE auxiliary losses by Megatron's names (load_balancing_loss, z_loss), without their
    # coefficients, averaged over micro-batches, MoE layers and DP; empty for a dense model
    moe_losses: dict[str, float] = field(default_factory=dict, compare=False)


class NumericalFaultError(MegapipeError, RuntimeError):
    """A numerical fault stopped training before the optimizer step touched the weights."""


class NonFiniteLossError(NumericalFaultError):
    """The loss became NaN or Inf (fp32/bf16): training stops before the weights are touched."""


class NonFiniteGradError(NumericalFaultError):
    """The gradient norm became NaN or Inf (fp32/bf16): stopped before the optimizer step."""


class SpikyLossError(NumericalFaultError):
    """--exit-on-spiky-loss: the loss jumped far above its running mean."""


class ReadAhead:
    """Reads micro-batch i + 1 when micro-batch i is asked for, so that on a GPU its host work
    and its (pinned, non-blocking) copy are issued before micro-batch i's compute and overlap
    it rather than stall the step between micro-batches. Each micro-batch is read once; asked
    for in any order, it still returns each one's own batch."""

    def __init__(self, read: Callable[[int], TrainingBatch], num_microbatches: int) -> None:
        self._read = read
        self._count = num_microbatches
        self._ahead: dict[int, TrainingBatch] = {}

    def __call__(self, microbatch: int) -> TrainingBatch:
        batch = self._ahead.pop(microbatch, None)
        if batch is None:
            batch = self._read(microbatch)
        following = microbatch + 1
        if following < self._count and following not in self._ahead:
            self._ahead[following] = self._read(following)
        return batch


@dataclass(frozen=True)
class GlobalBatch:
    """Which samples one step reads: [first_sample, first_sample + size) of the split, of
    which this data-parallel rank takes its contiguous share, one micro-batch at a time."""

    first_sample: int
    size: int
    micro_batch_size: int
    state: ParallelState

    @property
    def num_microbatches(self) -> int:
        return self.size // (self.micro_batch_size * self.state.dp.size)

    def indices(self, micro_batch: int) -> range:
        return micro_batch_range(
            0,
            micro_batch,
            first_sample=self.first_sample,
            global_batch_size=self.size,
            micro_batch_size=self.micro_batch_size,
            data_parallel_rank=self.state.dp.rank,
            data_parallel_size=self.state.dp.size,
        )

    def reader(self, data: BatchSource) -> Callable[[int], TrainingBatch]:
        """micro-batch index -> that micro-batch's batch, on this rank's device, read one
        micro-batch ahead (`ReadAhead`). Under context parallelism every rank of a CP group
        reads the same samples (sharded by DP only) and keeps its chunks of them
        (`split_batch`, global position ids)."""
        device, cp = self.state.device, self.state.cp
        return ReadAhead(
            lambda i: split_batch(data.batch(self.indices(i), device), cp.size, cp.rank),
            self.num_microbatches,
        )

    def sample_ids(self, micro_batch: int) -> torch.Tensor:
        """Global sample indices of a micro-batch: what keys the layout-invariant dropout."""
        return torch.tensor(list(self.indices(micro_batch)), dtype=torch.int64)


def train_step(
    chunks: Sequence[torch.nn.Module],
    optimizer: ShardedOptimizer,
    executor: PipelineExecutor,
    data: BatchSource,
    batch: GlobalBatch,
    state: ParallelState,
    *,
    lr: float,
    iteration: int,
    trace: TraceRecorder | None = None,
    count_zeros: bool = False,
    params_norm: bool = False,
    decoupled_lr: float | None = None,
) -> StepResult:
    """Run one iteration (1-based `iteration`, for messages) on this rank's share of `batch`.

    `executor` must run `batch.num_microbatches` micro-batches. `count_zeros` and `params_norm`
    (collective: every rank alike) add the gradient's zeros and the updated weights' norm.
    """
    scaler = optimizer.scaler
    optimizer.overlap_param_gather_with(chunks)  # --overlap-param-gather: once
    start_microbatches(chunks)  # TE: cast the new weights to fp8 once, on the first micro-batch
    for buffer in optimizer.buffers:
        buffer.expect_microbatches(batch.num_microbatches)
    aux_scale = (scaler.scale if scaler is not None else 1.0) / batch.num_microbatches
    for chunk in chunks:  # MoE aux losses' gradients start where the LM loss's do
        if getattr(chunk, "moe_losses", None) is not None:
            chunk.moe_losses.start_step(float(aux_scale))
    start = time.perf_counter()
    with optimizer.gradient_sync(executor.defers_weight_grads):
        losses = executor.run(
            batch.reader(data),
            sample_ids=batch.sample_ids,
            loss_scale=scaler.scale if scaler is not None else 1.0,
            trace=trace,
        )
    computed = time.perf_counter()
    mean_loss = start_global_mean_loss(losses, state)
    for buffer in optimizer.buffers:
        buffer.finish_grad_sync()
    finalize_model_grads(chunks, state)
    lm_loss = mean_loss.wait()
    moe_losses = reduce_moe_losses(chunks, state, batch.num_microbatches)
    reduced = time.perf_counter()
    checks = optimizer.config
    if scaler is None and checks.check_for_nan_in_loss_and_grad and not math.isfinite(lm_loss):
        raise NonFiniteLossError(
            f"iteration {iteration}: lm loss is {lm_loss} on rank {state.rank}; stopping "
            "before the optimizer step, so the weights are those of the previous iteration"
        )
    if checks.check_for_spiky_loss:
        _check_spike(optimizer.loss_history, lm_loss, iteration, state, checks)
    try:
        outcome = optimizer.step(lr, decoupled_lr)  # decoupled_lr: --decoupled-lr's groups
    except NonFiniteGradient as fault:
        raise NonFiniteGradError(_gradient_fault(fault, chunks, iteration, state)) from None
    update_expert_biases(chunks, state.dp_cp)  # --moe-router-enable-expert-bias (else nothing)
    zeros = optimizer.num_zeros_in_grad() if count_zeros and not outcome.skipped else None
    optimizer.zero_grad()
    timers = {
        "forward-backward": computed - start,
        "grads-reduce": reduced - computed,
        "optimizer": time.perf_counter() - reduced,
    }
    norm = optimizer.params_norm() if params_norm else None
    return StepResult(lm_loss, outcome.grad_norm, outcome.skipped, timers, zeros, norm, moe_losses)


@dataclass
class PendingLoss:
    """The step's mean loss on its way to every rank; `wait()` finishes it (collective: every
    rank calls it, after the same collectives) and returns it."""

    mean: torch.Tensor  # this pipeline's mean over its micro-batches, once broadcast
    broadcast: dist.Work | None
    state: ParallelState
    value: float | None = None

    def wait(self) -> float:
        """The mean over micro-batches and DP ranks: the broadcast waited for, then averaged
        over the data-parallel group (on every stage: each holds its pipeline's mean)."""
        if self.value is None:
            if self.broadcast is not None:
                self.broadcast.wait()
            if self.state.dp.size > 1:
                dist.all_reduce(self.mean, group=self.state.dp.pg)
                self.mean /= self.state.dp.size
            self.value = float(self.mean)
        return self.value


def start_global_mean_loss(losses: list[torch.Tensor], state: ParallelState) -> PendingLoss:
    """Start making the loss, computed on the last stage, known on every rank: the last stage's
    mean over its micro-batches is broadcast over the pipeline asynchronously, so that the
    gradient reductions run meanwhile; `PendingLoss.wait()` finishes it."""
    mean = torch.zeros((), dtype=torch.float32, device=state.device)
    if state.is_last_stage:
        mean = torch.stack(losses).float().mean()
    work = None
    if state.pp.size > 1:
        work = dist.broadcast(mean, src=state.pp.ranks[-1], group=state.pp.pg, async_op=True)
    return PendingLoss(mean, work, state)


def global_mean_loss(losses: list[torch.Tensor], state: ParallelState) -> float:
    """Mean over micro-batches and DP ranks, computed on the last stage, known on every rank."""
    return start_global_mean_loss(losses, state).wait()


def _gradient_fault(
    fault: NonFiniteGradient, chunks: Sequence[torch.nn.Module], iteration: int, state
) -> str:
    """One line: the iteration, the ranks whose gradients went bad, this rank's parameters."""
    names = {id(p): n for chunk in chunks for n, p in chunk.named_parameters()}
    mine = [names.get(id(p), f"a parameter of shape {tuple(p.shape)}") for p in fault.params]
    here = f"here in {', '.join(mine)}" if mine else "none here"
    return (
        f"iteration {iteration}: gradient norm is {fault.norm} on rank {state.rank}; "
        f"NaN/Inf gradients on rank(s) {', '.join(map(str, fault.ranks)) or 'none'} ({here}); "
        "stopping before the optimizer step, so the weights are those of the previous iteration"
    )


def _check_spike(history, lm_loss: float, iteration: int, state, checks) -> None:
    """--check-for-spiky-loss: warn (or, with --exit-on-spiky-loss, stop) when the loss is
    above --spiky-loss-factor times the mean of the previous iterations' losses (all ranks
    know the same loss, so all decide alike); `history` keeps the last ones (a deque)."""
    mean = sum(history) / len(history) if history else None
    if mean is not None and math.isfinite(lm_loss) and lm_loss > checks.spiky_loss_factor * mean:
        message = (
            f"iteration {iteration}: lm loss {lm_loss:.6E} is {lm_loss / mean:.1f} times the "
            f"mean {mean:.6E} of the previous {len(history)} iterations "
            f"(--spiky-loss-factor {checks.spiky_loss_factor:g})"
        )
        if checks.exit_on_spiky_loss:
            raise SpikyLossError(
                f"{message} on rank {state.rank}; stopping before the optimizer step, so the "
                "weights are those of the previous iteration"
            )
        if state.rank == 0:
            print(f"warning: {message}", file=sys.stderr, flush=True)
        return  # a spike does not enter the mean it is measured against
    if math.isfinite(lm_loss):
        history.append(lm_loss)
