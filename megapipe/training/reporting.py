"""Everything the loop reports: Megatron's log line (with throughput), the memory line after
the first iteration, validation lines, and TensorBoard scalars.

Kept apart from the loop so that `train.py` reads as the algorithm: step, maybe evaluate, maybe
stop. Who prints is Megatron's rule (`print_rank_last` for training and validation lines: the
last rank holds the last stage's loss); who writes TensorBoard is `TrainingTensorBoard`'s.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from megapipe.config import Configs
from megapipe.console import print_line
from megapipe.parallel.state import ParallelState
from megapipe.training.flops import (
    Throughput,
    device_peak_tflops,
    flops_per_iteration,
    throughput,
)
from megapipe.training.interval_stats import IntervalStats
from megapipe.training.log_format import iteration_line, validation_block
from megapipe.training.memory_report import memory_report_line, memory_scalars
from megapipe.training.printing import print_rank_last
from megapipe.training.step import StepResult
from megapipe.training.tensorboard_log import TrainingTensorBoard
from megapipe.training.wandb_log import wandb_maker


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def peak_tflops(configs: Configs, device: torch.device) -> float | None:
    """--device-peak-tflops, else the known dense peak of this GPU in the training precision."""
    if configs.logging.device_peak_tflops is not None:
        return configs.logging.device_peak_tflops
    if device.type != "cuda":
        return None
    return device_peak_tflops(torch.cuda.get_device_name(device), configs.optimizer.params_dtype)


class TrainingReporter:
    """Accumulates one log interval and reports it; reports validation results."""

    def __init__(self, configs: Configs, state: ParallelState) -> None:
        self.configs, self.state = configs, state
        logging = configs.logging
        self.tensorboard = TrainingTensorBoard.open_for(
            state,
            logging.tensorboard_dir,
            wandb=wandb_maker(configs),
            queue_size=logging.tensorboard_queue_size,
            log_interval=logging.tensorboard_log_interval,
            log_validation_ppl=logging.log_validation_ppl_to_tensorboard,
        )
        if self.tensorboard is not None:
            self.tensorboard.log_arguments(dict(configs.arguments))
        self.peak = peak_tflops(configs, state.device)
        self.padded_vocab = configs.model.padded_vocab_size(
            configs.parallel.tensor_model_parallel_size
        )
        self.stats = IntervalStats()
        self.interval_flops = 0
        self.interval_tokens = 0
        self.interval_time = 0.0
        self.timers: dict[str, float] = {}
        self._started = 0.0
        self.memory_reported = False

    def start_iteration(self) -> None:
        self._started = _now(self.state.device)

    def end_iteration(
        self,
        iteration: int,
        consumed_samples: int,
        batch_size: int,
        result: StepResult,
        learning_rate: float,
        loss_scale: float,
        decoupled_learning_rate: float | None = None,
    ) -> None:
        """Record iteration `iteration` (1-based), which consumed samples up to
        `consumed_samples`; print the log line at --log-interval. `decoupled_learning_rate`
        (--decoupled-lr's) goes to TensorBoard only: the log line shows --lr's, as Megatron's."""
        self._accumulate(_now(self.state.device) - self._started, batch_size, result)
        if not self.memory_reported:
            print_line(memory_report_line(self.state.rank, iteration, self.state.device))
            self.memory_reported = True
        at_log = iteration % self.configs.training.log_interval == 0
        speed = self._throughput() if at_log and self.configs.logging.log_throughput else None
        if self.tensorboard is not None:
            self._log_tensorboard(
                iteration, consumed_samples, batch_size, result, learning_rate, loss_scale,
                at_log=at_log, speed=speed, decoupled_learning_rate=decoupled_learning_rate,
            )  # fmt: skip
        if not at_log:
            return
        line = iteration_line(
            iteration=iteration,
            train_iters=self.configs.training.train_iters,
            consumed_samples=consumed_samples,
            elapsed_ms_per_iteration=self.interval_time * 1000.0 / self.stats.iterations,
            learning_rate=learning_rate,
            global_batch_size=batch_size,
            losses=self.stats.averages(),
            loss_scale=loss_scale,
            grad_norm=result.grad_norm,
            num_zeros=result.num_zeros,
            params_norm=result.params_norm,
            skipped_iterations=self.stats.skipped_iterations,
            nan_iterations=self.stats.nan_iterations,
            **(dataclasses.asdict(speed) if speed else {}),
        )
        print_rank_last(self.state, line)
        self._reset_interval()

    def _accumulate(self, elapsed: float, batch_size: int, result: StepResult) -> None:
        """Add one iteration to the interval: its loss, time, FLOPs, tokens and timers."""
        model = self.configs.model
        losses = {"lm loss": result.lm_loss, **result.moe_losses}  # MoE: Megatron's names
        self.stats.add(losses, skipped=result.skipped)
        self.interval_time += elapsed
        self.interval_flops += flops_per_iteration(
            model, batch_size, padded_vocab_size=self.padded_vocab
        )
        self.interval_tokens += batch_size * model.seq_length
        for name, seconds in result.timers.items():
            self.timers[name] = self.timers.get(name, 0.0) + seconds

    def _throughput(self) -> Throughput:
        """The interval's mean throughput per iteration."""
        iterations = self.stats.iterations
        return throughput(
            flops_per_iteration=self.interval_flops // iterations,
            seconds_per_iteration=self.interval_time / iterations,
            tokens_per_iteration=self.interval_tokens // iterations,
            world_size=self.state.world_size,
            peak_tflops=self.peak,
        )

    def _log_tensorboard(
        self,
        iteration: int,
        consumed_samples: int,
        batch_size: int,
        result: StepResult,
        learning_rate: float,
        loss_scale: float,
        *,
        at_log: bool,
        speed: Throughput | None,
        decoupled_learning_rate: float | None = None,
    ) -> None:
        """This iteration's scalars, with the interval's means at --log-interval."""
        logging, iterations = self.configs.logging, self.stats.iterations
        timing = at_log and logging.log_timers_to_tensorboard
        self.tensorboard.log_train(
            iteration,
            consumed_samples,
            losses={"lm loss": result.lm_loss, **result.moe_losses},
            learning_rate=learning_rate if logging.log_learning_rate_to_tensorboard else None,
            decoupled_learning_rate=(
                decoupled_learning_rate if logging.log_learning_rate_to_tensorboard else None
            ),
            grad_norm=result.grad_norm,
            loss_scale=loss_scale if logging.log_loss_scale_to_tensorboard else None,
            batch_size=batch_size if logging.log_batch_size_to_tensorboard else None,
            iteration_time_s=self.interval_time / iterations if at_log else None,
            throughput_tflops=speed.throughput_tflops_per_gpu if speed else None,
            timers={k: v / iterations for k, v in self.timers.items()} if timing else None,
            world_size=self.state.world_size if logging.log_world_size_to_tensorboard else None,
            num_zeros=result.num_zeros,
            params_norm=result.params_norm,
            memory=memory_scalars(self.state.device) if logging.log_memory_to_tensorboard else None,
        )

    def _reset_interval(self) -> None:
        self.stats.reset()
        self.interval_flops = self.interval_tokens = 0
        self.interval_time = 0.0
        self.timers = {}

    def validation(
        self, prefix: str, losses: dict[str, float], iteration: int, consumed_samples: int
    ) -> None:
        """Megatron's validation block; TensorBoard's validation scalars for the valid split."""
        print_rank_last(self.state, validation_block(prefix, losses))
        if self.tensorboard is not None and "test" not in prefix:
            self.tensorboard.log_validation(iteration, consumed_samples, losses)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
