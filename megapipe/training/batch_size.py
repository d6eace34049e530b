"""The global batch size of each iteration: constant, or ramped up as Megatron's
`--rampup-batch-size START INCREMENT SAMPLES` asks.

With a ramp-up the global batch starts at START and grows by INCREMENT every
SAMPLES / ((GLOBAL - START) / INCREMENT) consumed samples, reaching --global-batch-size after
SAMPLES samples; the number of micro-batches per step changes with it (the micro-batch size and
data-parallel size do not). As in megatron.core's calculator, the batch size of an iteration is
a pure function of the samples consumed before it, so a resumed run sees the same sizes.

Megatron-LM refuses a ramp-up with iteration-based training (`--train-iters`), although its own
GPT-3 example asks for exactly that; megapipe runs it: the ramp is in samples either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from megapipe.config import TrainingConfig
from megapipe.errors import ConfigError


@dataclass(frozen=True)
class BatchSizeSchedule:
    """Global batch size and micro-batch count as functions of the consumed samples."""

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup: tuple[int, int, int] | None = None  # start, increment, ramp-up samples

    @property
    def samples_per_microbatch_step(self) -> int:
        """Samples one micro-batch slot takes across data-parallel ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def validate(self) -> None:
        """ConfigError naming the flags when the ramp cannot be run as asked."""
        step = self.samples_per_microbatch_step
        if self.rampup is None:
            return
        start, increment, samples = self.rampup
        flag = "--rampup-batch-size"
        if start <= 0 or increment <= 0 or samples < 0:
            raise ConfigError(
                f"{flag} {start} {increment} {samples}: start and increment must be positive "
                "and the ramp-up samples non-negative"
            )
        if start > self.global_batch_size:
            raise ConfigError(
                f"{flag} start ({start}) exceeds --global-batch-size ({self.global_batch_size})"
            )
        if (self.global_batch_size - start) % increment:
            raise ConfigError(
                f"--global-batch-size ({self.global_batch_size}) minus {flag} start ({start}) "
                f"must be a multiple of its increment ({increment})"
            )
        for name, value in (("start", start), ("increment", increment)):
            if value % step:
                raise ConfigError(
                    f"{flag} {name} ({value}) must be a multiple of --micro-batch-size "
                    f"({self.micro_batch_size}) x data-parallel size ({self.data_parallel_size})"
                    f" = {step}: every ramped batch is a whole number of micro-batches per rank"
                )

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, increment, samples = self.rampup
        increments = (self.global_batch_size - start) // increment
        if increments == 0 or consumed_samples > samples:
            return self.global_batch_size
        per_increment = samples / increments
        return min(
            self.global_batch_size, start + int(consumed_samples / per_increment) * increment
        )

    def num_microbatches_at(self, consumed_samples: int) -> int:
        return self.global_batch_size_at(consumed_samples) // self.samples_per_microbatch_step

    def batch_sizes(self) -> Iterator[int]:
        """Every distinct global batch size the run can use, smallest first."""
        if self.rampup is None:
            yield self.global_batch_size
            return
        start, increment, _ = self.rampup
        yield from range(start, self.global_batch_size + 1, increment)

    def iterations_for_samples(self, train_samples: int) -> int:
        """Iterations that `--train-samples` samples take (Megatron's update_train_iters)."""
        if self.rampup is None:
            return train_samples // self.global_batch_size
        consumed = iterations = 0
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.global_batch_size_at(consumed)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch_size
        return iterations

    def samples_for_iterations(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` iterations."""
        consumed = 0
        for _ in range(iterations):
            if self.rampup is None or consumed > self.rampup[2]:
                break
            consumed += self.global_batch_size_at(consumed)
            iterations -= 1
        return consumed + iterations * self.global_batch_size


def batch_size_schedule_of(training: TrainingConfig, data_parallel_size: int) -> BatchSizeSchedule:
    """The batch-size schedule of these training flags at this data-parallel size."""
    return BatchSizeSchedule(
        training.global_batch_size,
        training.micro_batch_size,
        data_parallel_size,
        training.rampup_batch_size,
    )
