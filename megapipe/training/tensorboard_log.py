"""TensorBoard scalars under Megatron-LM's names, written by one rank of the job.

Megatron's scalar names and rules, kept so that users' dashboards and scripts carry over:

- every --tensorboard-log-interval iterations: `learning-rate`, `batch-size`, each loss by its
  name (`lm loss`), `loss-scale`, `grad-norm`, each with `<name> vs samples` stepped by the
  consumed training samples;
- at the stdout --log-interval, with --log-timers-to-tensorboard: `iteration-time` (seconds),
  `throughput` (TFLOP/s per GPU, with --log-throughput) and each timer as `<timer>-time`
  (seconds), stepped by iteration only (Megatron writes no `vs samples` for these);
- after each evaluation: `lm loss validation`, `lm loss validation vs samples`,
  `lm loss validation ppl`, `lm loss validation ppl vs samples` (ppl = exp(min(20, loss)));
- at start-up, one text entry per argument (tag = the argument's name), as Megatron's
  `write_args_to_tensorboard`: each is findable by name in TensorBoard's text tab.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

from torch.utils.tensorboard import SummaryWriter

from megapipe.parallel.state import ParallelState
from megapipe.training.log_format import perplexity


class TrainingTensorBoard:
    """One event-file writer for a training run; create it only where `writes_on` is True."""

    def __init__(
        self,
        log_dir: str,
        *,
        queue_size: int = 1000,
        log_interval: int = 1,
        log_validation_ppl: bool = True,
    ) -> None:
        """queue_size: --tensorboard-queue-size (events buffered before a write to disk);
        log_interval: --tensorboard-log-interval; log_validation_ppl: whether validation
        perplexities are written (Megatron's --log-validation-ppl-to-tensorboard)."""
        if queue_size <= 0:
            raise ValueError(f"--tensorboard-queue-size must be positive, got {queue_size}")
        if log_interval <= 0:
            raise ValueError(f"--tensorboard-log-interval must be positive, got {log_interval}")
        self.log_interval = log_interval
        self.log_validation_ppl = log_validation_ppl
        self._writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    @staticmethod
    def writes_on(state: ParallelState) -> bool:
        """The one writing rank: the last pipeline stage (which holds the loss), first TP and
        first DP rank. (Megatron writes from global rank world-1: the same stage, but the
        last TP/DP rank; any one rank of that stage sees the same reduced values.)"""
        return state.is_last_stage and state.tp_rank == 0 and state.dp_rank == 0

    @classmethod
    def open_for(
        cls, state: ParallelState, log_dir: str | None, **options: int | bool
    ) -> TrainingTensorBoard | None:
        """A writer on the writing rank when --tensorboard-dir is set, else None."""
        if log_dir is None or not cls.writes_on(state):
            return None
        return cls(log_dir, **options)

    def _pair(self, tag: str, value: float, iteration: int, consumed_samples: int) -> None:
        self._writer.add_scalar(tag, value, iteration)
        self._writer.add_scalar(f"{tag} vs samples", value, consumed_samples)

    def log_arguments(self, args: Mapping[str, object], step: int = 0) -> None:
        """Each argument as a text entry named after it, its value as str(value)."""
        for name in sorted(args):
            self._writer.add_text(name, str(args[name]), global_step=step)

    def log_train(
        self,
        iteration: int,
        consumed_samples: int,
        *,
        losses: Mapping[str, float],
        learning_rate: float | None,
        grad_norm: float | None,
        loss_scale: float | None,
        batch_size: int | None,
        iteration_time_s: float | None = None,
        throughput_tflops: float | None = None,
        timers: Mapping[str, float] | None = None,
    ) -> None:
        """One iteration's scalars. The first group is written only when iteration is a
        multiple of the log interval (None values are skipped). iteration_time_s,
        throughput_tflops and timers (seconds per iteration, by timer name) are written
        whenever given: pass them on --log-interval iterations under
        --log-timers-to-tensorboard, as Megatron does."""
        if iteration % self.log_interval == 0:
            if learning_rate is not None:
                self._pair("learning-rate", learning_rate, iteration, consumed_samples)
            if batch_size is not None:
                self._pair("batch-size", batch_size, iteration, consumed_samples)
            for name, value in losses.items():
                self._pair(name, value, iteration, consumed_samples)
            if loss_scale is not None:
                self._pair("loss-scale", loss_scale, iteration, consumed_samples)
            if grad_norm is not None:
                self._pair("grad-norm", grad_norm, iteration, consumed_samples)
        if iteration_time_s is not None:
            self._writer.add_scalar("iteration-time", iteration_time_s, iteration)
        if throughput_tflops is not None:
            self._writer.add_scalar("throughput", throughput_tflops, iteration)
        for name, seconds in (timers or {}).items():
            self._writer.add_scalar(f"{name}-time", seconds, iteration)

    def log_validation(
        self, iteration: int, consumed_samples: int, losses: Mapping[str, float]
    ) -> None:
        """One evaluation's losses (and perplexities), by iteration and by consumed samples."""
        for name, value in losses.items():
            self._pair(f"{name} validation", value, iteration, consumed_samples)
            if self.log_validation_ppl:
                ppl = perplexity(value)
                self._pair(f"{name} validation ppl", ppl, iteration, consumed_samples)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TrainingTensorBoard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
