"""TensorBoard scalars under Megatron-LM's names, written by one rank of the job.

Megatron's scalar names and rules, kept so that users' dashboards and scripts carry over:

- every --tensorboard-log-interval iterations: `learning-rate` (`decoupled-learning-rate` too
  with --decoupled-lr), `batch-size`, each loss by its name (`lm loss`), `loss-scale`,
  `grad-norm`, each with `<name> vs samples` stepped by the consumed training samples;
- at the stdout --log-interval, with --log-timers-to-tensorboard: `iteration-time` (seconds),
  `throughput` (TFLOP/s per GPU, with --log-throughput) and each timer as `<timer>-time`
  (seconds), stepped by iteration only (Megatron writes no `vs samples` for these);
- after each evaluation: `lm loss validation`, `lm loss validation vs samples`,
  `lm loss validation ppl`, `lm loss validation ppl vs samples` (ppl = exp(min(20, loss)));
- at start-up, one text entry per argument (tag = the argument's name), as Megatron's
  `write_args_to_tensorboard`: each is findable by name in TensorBoard's text tab;
- with their flags, in the first group: `world-size`, `num-zeros`, `params-norm` (each with
  `vs samples`) and the memory scalars (`memory_report.memory_scalars`, by iteration only).

The scalars go to every `ScalarBackend` the writer holds: TensorBoard's event files
(`EventFileBackend`, --tensorboard-dir) and Weights & Biases (`wandb_log.WandbBackend`,
--wandb-project), so both get the same list from one place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Protocol

from torch.utils.tensorboard import SummaryWriter

from megapipe.parallel.state import ParallelState
from megapipe.training.log_format import perplexity


class ScalarBackend(Protocol):
    """Where the run's scalars and texts end up (TensorBoard event files, Weights & Biases)."""

    def scalar(self, tag: str, value: float, iteration: int) -> None: ...

    def scalar_vs_samples(
        self, tag: str, value: float, iteration: int, consumed_samples: int
    ) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class EventFileBackend:
    """TensorBoard's event files: `tag` by iteration, `tag vs samples` by consumed samples."""

    def __init__(self, log_dir: str, queue_size: int) -> None:
        self._writer = SummaryWriter(log_dir=log_dir, max_queue=queue_size)

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        self._writer.add_scalar(tag, value, iteration)

    def scalar_vs_samples(
        self, tag: str, value: float, iteration: int, consumed_samples: int
    ) -> None:
        self._writer.add_scalar(f"{tag} vs samples", value, consumed_samples)

    def text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class TrainingTensorBoard:
    """The run's scalar writer (TensorBoard, and W&B beside it); create it only where
    `writes_on` is True."""

    def __init__(
        self,
        log_dir: str | None,
        *,
        queue_size: int = 1000,
        log_interval: int = 1,
        log_validation_ppl: bool = True,
        backends: Sequence[ScalarBackend] = (),
    ) -> None:
        """log_dir: --tensorboard-dir (None: no event files, only `backends`); queue_size:
        --tensorboard-queue-size (events buffered before a write to disk); log_interval:
        --tensorboard-log-interval; log_validation_ppl: whether validation perplexities are
        written (Megatron's --log-validation-ppl-to-tensorboard); backends: further writers
        (Weights & Biases)."""
        if queue_size <= 0:
            raise ValueError(f"--tensorboard-queue-size must be positive, got {queue_size}")
        if log_interval <= 0:
            raise ValueError(f"--tensorboard-log-interval must be positive, got {log_interval}")
        self.log_interval = log_interval
        self.log_validation_ppl = log_validation_ppl
        files = [EventFileBackend(log_dir, queue_size)] if log_dir is not None else []
        self._backends: list[ScalarBackend] = [*files, *backends]

    @staticmethod
    def writes_on(state: ParallelState) -> bool:
        """The one writing rank: the last pipeline stage (which holds the loss), first TP and
        first DP (and CP) rank. (Megatron writes from global rank world-1: the same stage, but
        the last TP/DP rank; any one rank of that stage sees the same reduced values.)"""
        return state.is_last_stage and state.tp_rank == 0 and state.dp_cp.rank == 0

    @classmethod
    def open_for(
        cls,
        state: ParallelState,
        log_dir: str | None,
        *,
        wandb: Callable[[], ScalarBackend] | None = None,
        **options: int | bool,
    ) -> TrainingTensorBoard | None:
        """A writer on the writing rank when --tensorboard-dir is set or `wandb` (the W&B
        backend's maker, called there only) is given, else None."""
        if (log_dir is None and wandb is None) or not cls.writes_on(state):
            return None
        return cls(log_dir, backends=[wandb()] if wandb is not None else [], **options)

    def _scalar(self, tag: str, value: float, iteration: int) -> None:
        for backend in self._backends:
            backend.scalar(tag, value, iteration)

    def _pair(self, tag: str, value: float, iteration: int, consumed_samples: int) -> None:
        for backend in self._backends:
            backend.scalar(tag, value, iteration)
            backend.scalar_vs_samples(tag, value, iteration, consumed_samples)

    def log_arguments(self, args: Mapping[str, object], step: int = 0) -> None:
        """Each argument as a text entry named after it, its value as str(value)."""
        for name in sorted(args):
            for backend in self._backends:
                backend.text(name, str(args[name]), step)

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
        world_size: int | None = None,
        num_zeros: float | None = None,
        params_norm: float | None = None,
        memory: Mapping[str, float] | None = None,
        decoupled_learning_rate: float | None = None,
    ) -> None:
        """One iteration's scalars. The first group is written only when iteration is a
        multiple of the log interval (None values are skipped; `memory` by iteration only).
        iteration_time_s, throughput_tflops and timers (seconds per iteration, by timer name)
        are written whenever given: pass them on --log-interval iterations under
        --log-timers-to-tensorboard, as Megatron does."""
        if iteration % self.log_interval == 0:
            if learning_rate is not None:
                self._pair("learning-rate", learning_rate, iteration, consumed_samples)
            if decoupled_learning_rate is not None:  # --decoupled-lr's, as Megatron names it
                self._pair(
                    "decoupled-learning-rate", decoupled_learning_rate, iteration, consumed_samples
                )
            if batch_size is not None:
                self._pair("batch-size", batch_size, iteration, consumed_samples)
            for name, value in losses.items():
                self._pair(name, value, iteration, consumed_samples)
            if loss_scale is not None:
                self._pair("loss-scale", loss_scale, iteration, consumed_samples)
            if world_size is not None:
                self._pair("world-size", world_size, iteration, consumed_samples)
            if grad_norm is not None:
                self._pair("grad-norm", grad_norm, iteration, consumed_samples)
            if num_zeros is not None:
                self._pair("num-zeros", num_zeros, iteration, consumed_samples)
            if params_norm is not None:
                self._pair("params-norm", params_norm, iteration, consumed_samples)
            for name, value in (memory or {}).items():
                self._scalar(name, value, iteration)
        if iteration_time_s is not None:
            self._scalar("iteration-time", iteration_time_s, iteration)
        if throughput_tflops is not None:
            self._scalar("throughput", throughput_tflops, iteration)
        for name, seconds in (timers or {}).items():
            self._scalar(f"{name}-time", seconds, iteration)

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
        for backend in self._backends:
            backend.flush()

    def close(self) -> None:
        for backend in self._backends:
            backend.close()

    def __enter__(self) -> TrainingTensorBoard:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
