"""The run's optimizer-parameter schedule: --lr's, --decoupled-lr's, and the weight decay.

What the training loop asks at each step (the learning rates after so many samples of
successful updates) and what a checkpoint records of it: `settings`, under the names of
Megatron-LM's `opt_param_scheduler` (steps in samples). A resumed run follows the settings
that `checkpointing.scheduler_rule.settle` chose (`following`): the command line's or the
checkpoint's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megapipe.checkpointing.scheduler_rule import ScheduleSettings
from megapipe.config import OptimizerConfig, TrainingConfig
from megapipe.training.lr_schedule import LRSchedule, decoupled_schedule_of, lr_schedule_of


def _samples(value: float) -> int | float:
    """A step count in samples: whole when it is (Megatron's ints), else as it is."""
    return round(value) if abs(value - round(value)) < 1e-6 else value


def _flags(training: TrainingConfig) -> dict[str, str]:
    """The flag behind each setting, as the user gave it (for the resume rule's message)."""
    unit = "samples" if training.train_samples is not None else "iters"
    length = f"--train-{unit}"
    decay = f"--lr-decay-{unit}" if training.lr_decay_iters is not None else length
    warmup = f"--lr-warmup-{unit}"
    if training.lr_warmup_fraction is not None:
        warmup = f"--lr-warmup-fraction of {decay}"
    return {
        "max_lr": "--lr",
        "min_lr": "--min-lr",
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": "--lr-decay-style",
        "start_wd": "--weight-decay",
        "end_wd": "--weight-decay",
        "wd_incr_steps": length,
        "wd_incr_style": "the weight-decay increment style (megapipe: constant)",
        "decoupled_lr": "--decoupled-lr",
        "decoupled_min_lr": "--decoupled-min-lr",
    }


@dataclass(frozen=True)
class OptimizerSchedule:
    """The two learning-rate schedules and the weight decay one run follows."""

    lr: LRSchedule  # every parameter's, or all but the embedding and output layer's
    decoupled: LRSchedule | None  # --decoupled-lr's: the embedding and output layer's
    weight_decay: float
    wd_incr_steps: float  # Megatron's weight-decay increment length: the run's samples
    flags: dict[str, str]
    train_iters: int

    @classmethod
    def of(cls, training: TrainingConfig, optimizer: OptimizerConfig) -> OptimizerSchedule:
        """The schedule the flags describe (ConfigError if they conflict)."""
        samples = training.train_samples
        if samples is None:
            samples = training.train_iters * training.global_batch_size
        return cls(
            lr_schedule_of(training),
            decoupled_schedule_of(training),
            optimizer.weight_decay,
            samples,
            _flags(training),
            training.train_iters,
        )

    def rates(self, scheduled_samples: int) -> tuple[float, float | None]:
        """(--lr's rate, --decoupled-lr's or None) after that many samples of updates."""
        updates = scheduled_samples / self.lr.global_batch_size
        decoupled = self.decoupled.lr_at(updates) if self.decoupled is not None else None
        return self.lr.lr_at(updates), decoupled

    def settings(self) -> ScheduleSettings:
        """The settings under Megatron's names, steps in samples (what a checkpoint keeps)."""
        lr, g = self.lr, self.lr.global_batch_size
        values: dict[str, object] = {
            "max_lr": lr.max_lr,
            "min_lr": lr.min_lr,
            "lr_warmup_steps": _samples(lr.warmup_iters * g),
            "lr_decay_steps": _samples(lr.decay_iters * g),
            "lr_decay_style": lr.decay_style,
            "start_wd": self.weight_decay,
            "end_wd": self.weight_decay,
            "wd_incr_steps": _samples(self.wd_incr_steps),
            "wd_incr_style": "constant",
            "decoupled_lr": self.decoupled.max_lr if self.decoupled is not None else None,
            "decoupled_min_lr": self.decoupled.min_lr if self.decoupled is not None else None,
        }
        return ScheduleSettings(values, self.flags, g, self.train_iters)

    def following(self, values: dict[str, object]) -> OptimizerSchedule:
        """This schedule with the settings `values` (a checkpoint's, or these same ones); what
        no setting records (warm-up start, WSD's anneal) stays the command line's."""
        g = self.lr.global_batch_size
        lr = dataclasses.replace(
            self.lr,
            max_lr=float(values["max_lr"]),
            min_lr=float(values["min_lr"]),
            warmup_iters=float(values["lr_warmup_steps"]) / g,
            decay_iters=float(values["lr_decay_steps"]) / g,
            decay_style=str(values["lr_decay_style"]),
        )
        decoupled = None
        if values["decoupled_lr"] is not None:
            floor = values["decoupled_min_lr"]
            floor = lr.min_lr if floor is None else float(floor)
            decoupled = dataclasses.replace(lr, max_lr=float(values["decoupled_lr"]), min_lr=floor)
        wd, wd_incr_steps = float(values["end_wd"]), float(values["wd_incr_steps"])
        return OptimizerSchedule(lr, decoupled, wd, wd_incr_steps, self.flags, self.train_iters)
