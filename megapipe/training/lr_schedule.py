"""The learning-rate schedule, as a pure function of the number of optimizer updates.

Reproduces Megatron-LM's `OptimizerParamScheduler.get_lr`: linear warmup from `--lr-warmup-init`
to `--lr`, then constant, linear, cosine, inverse-square-root or WSD (warmup-stable-decay) down to
`--min-lr` at `--lr-decay-iters`, and `--min-lr` after that (except `constant`, which Megatron
keeps at `--lr` forever).

Megatron counts scheduler steps in *samples* (iterations x global batch size). For every style the
ratios make that unit cancel, except inverse-square-root without warmup, whose `max(steps, 1)`
clamp then depends on the batch size; `global_batch_size` keeps that case exact.

Being pure (no step counter inside), the schedule needs no checkpoint state but its settings
(recorded for Megatron's resume rule: `optimizer_schedule.py`): the caller passes the number of
*successful* updates so far. Megatron does not advance its scheduler on an iteration
the fp16 loss scaler skipped, so that count, not the iteration number, is the argument.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megapipe.config import TrainingConfig
from megapipe.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's LR schedule in iterations. Validated on construction (ConfigError)."""

    max_lr: float  # --lr
    decay_iters: int  # --lr-decay-iters (default --train-iters)
    min_lr: float = 0.0  # --min-lr
    warmup_iters: float = 0.0  # --lr-warmup-iters; fractional from --lr-warmup-fraction
    decay_style: str = "linear"  # --lr-decay-style
    wsd_decay_iters: int | None = None  # --lr-wsd-decay-iters: length of WSD's anneal
    wsd_decay_style: str = "exponential"  # --lr-wsd-decay-style
    warmup_init_lr: float = 0.0  # --lr-warmup-init: where warmup starts
    global_batch_size: int = 1  # samples per update: Megatron's scheduler unit

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _require(self.max_lr >= 0, f"--lr must not be negative, got {self.max_lr}")
        _require(self.min_lr >= 0, f"--min-lr must not be negative, got {self.min_lr}")
        _require(
            self.min_lr <= self.max_lr,
            f"--min-lr ({self.min_lr}) must not exceed --lr ({self.max_lr})",
        )
        _require(
            0 <= self.warmup_init_lr <= self.max_lr,
            f"--lr-warmup-init ({self.warmup_init_lr}) must be in [0, --lr ({self.max_lr})]",
        )
        _require(
            self.decay_style in DECAY_STYLES,
            f"--lr-decay-style {self.decay_style!r} is not one of {', '.join(DECAY_STYLES)}",
        )
        _require(
            self.wsd_decay_style in WSD_DECAY_STYLES,
            f"--lr-wsd-decay-style {self.wsd_decay_style!r} is not one of "
            f"{', '.join(WSD_DECAY_STYLES)}",
        )
        _require(
            self.global_batch_size > 0,
            f"--global-batch-size must be positive, got {self.global_batch_size}",
        )
        _require(self.decay_iters > 0, f"--lr-decay-iters must be positive, got {self.decay_iters}")
        _require(
            self.warmup_iters >= 0,
            f"--lr-warmup-iters must not be negative, got {self.warmup_iters}",
        )
        _require(
            self.warmup_iters < self.decay_iters,
            f"--lr-warmup-iters ({self.warmup_iters}) must be less than "
            f"--lr-decay-iters ({self.decay_iters})",
        )
        if self.wsd_decay_iters is not None:
            _require(
                self.wsd_decay_iters >= 0,
                f"--lr-wsd-decay-iters must not be negative, got {self.wsd_decay_iters}",
            )
        if self.decay_style == "WSD":
            _require(
                self.wsd_decay_iters is not None,
                "--lr-decay-style WSD needs --lr-wsd-decay-iters",
            )
            # Stricter than Megatron, which lets the anneal overlap warmup (a jump in the LR).
            _require(
                self.wsd_decay_iters <= self.decay_iters - self.warmup_iters,
                f"--lr-wsd-decay-iters ({self.wsd_decay_iters}) must not exceed --lr-decay-iters "
                f"({self.decay_iters}) minus the warmup iterations ({self.warmup_iters})",
            )

    def lr_at(self, iteration: float) -> float:
        """The LR after `iteration` successful updates (Megatron's scheduler at that step count).

        Update k (1-based) uses `lr_at(k - 1)`; Megatron's log line at iteration k shows
        `lr_at(k)`, the rate the scheduler set after stepping.
        """
        if iteration < 0:
            raise ValueError(f"iteration must not be negative, got {iteration}")
        g = self.global_batch_size
        step = iteration * g
        warmup = self.warmup_iters * g
        decay = self.decay_iters * g
        max_lr, min_lr = self.max_lr, self.min_lr

        if warmup > 0 and step <= warmup:
            init = self.warmup_init_lr
            return init + (max_lr - init) * float(step) / float(warmup)
        if self.decay_style == "constant":
            return max_lr
        if step > decay:
            return min_lr
        if self.decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(step, 1) ** 0.5)

        ratio = float(step - warmup) / float(decay - warmup)
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = _cosine(ratio)
        else:  # WSD
            coeff = self._wsd_coeff(step, decay)
        return min_lr + coeff * (max_lr - min_lr)

    def _wsd_coeff(self, step: float, decay: float) -> float:
        """1 during the stable phase, then the anneal from 1 to 0 over the last wsd_decay_iters."""
        anneal = self.wsd_decay_iters * self.global_batch_size
        anneal_start = decay - anneal
        if step <= anneal_start:
            return 1.0
        r = float(step - anneal_start) / float(anneal)
        style = self.wsd_decay_style
        if style == "linear":
            return 1.0 - r
        if style == "cosine":
            return _cosine(r)
        if style == "exponential":
            return 2.0 * 0.5**r - 1.0
        return 1.0 - math.sqrt(r)  # minus_sqrt


def _cosine(ratio: float) -> float:
    return 0.5 * (math.cos(math.pi * ratio) + 1.0)


def resolve_schedule(
    *,
    lr: float | None,
    min_lr: float = 0.0,
    train_iters: int | None = None,
    lr_decay_iters: int | None = None,
    lr_warmup_iters: int | None = 0,
    lr_warmup_fraction: float | None = None,
    lr_decay_style: str = "linear",
    lr_wsd_decay_iters: int | None = None,
    lr_wsd_decay_style: str = "exponential",
    lr_warmup_init: float = 0.0,
    global_batch_size: int = 1,
) -> LRSchedule:
    """Megatron's flag semantics -> LRSchedule, or ConfigError naming the flags.

    --lr-decay-iters defaults to --train-iters; --lr-warmup-fraction is a fraction of the decay
    iterations and excludes a non-zero --lr-warmup-iters (0 is Megatron's default, so not "given").
    """
    _require(lr is not None, "--lr is required")
    decay_iters = _decay_iters(train_iters, lr_decay_iters)
    warmup = _warmup_iters(lr_warmup_iters, lr_warmup_fraction, decay_iters, lr_decay_iters)
    return LRSchedule(
        max_lr=lr,
        decay_iters=decay_iters,
        min_lr=min_lr,
        warmup_iters=warmup,
        decay_style=lr_decay_style,
        wsd_decay_iters=lr_wsd_decay_iters,
        wsd_decay_style=lr_wsd_decay_style,
        warmup_init_lr=lr_warmup_init,
        global_batch_size=global_batch_size,
    )


def _decay_iters(train_iters: int | None, lr_decay_iters: int | None) -> int:
    """--lr-decay-iters, defaulting to a positive --train-iters."""
    if lr_decay_iters is not None:
        _require(lr_decay_iters > 0, f"--lr-decay-iters must be positive, got {lr_decay_iters}")
        return lr_decay_iters
    _require(train_iters is not None, "--lr-decay-iters or --train-iters is required")
    _require(
        train_iters > 0,
        f"--lr-decay-iters defaults to --train-iters, which must be positive, got {train_iters}",
    )
    return train_iters


def _warmup_iters(
    lr_warmup_iters: int | None,
    lr_warmup_fraction: float | None,
    decay_iters: int,
    lr_decay_iters: int | None,
) -> float:
    """Warm-up iterations: --lr-warmup-iters, or --lr-warmup-fraction of the decay iterations."""
    warmup_iters = lr_warmup_iters or 0
    _require(warmup_iters >= 0, f"--lr-warmup-iters must not be negative, got {warmup_iters}")
    if lr_warmup_fraction is not None:
        _require(
            warmup_iters == 0,
            f"give one of --lr-warmup-iters ({warmup_iters}) and --lr-warmup-fraction "
            f"({lr_warmup_fraction}), not both",
        )
        _require(
            0.0 <= lr_warmup_fraction < 1.0,
            f"--lr-warmup-fraction must be in [0, 1), got {lr_warmup_fraction}",
        )
        return lr_warmup_fraction * decay_iters
    _require(
        warmup_iters < decay_iters,
        f"--lr-warmup-iters ({warmup_iters}) must be less than --lr-decay-iters ({decay_iters})"
        + ("" if lr_decay_iters is not None else ", which defaults to --train-iters"),
    )
    return warmup_iters


def lr_schedule_of(training: TrainingConfig) -> LRSchedule:
    """The learning-rate schedule the training flags describe (ConfigError if they conflict)."""
    return resolve_schedule(
        lr=training.lr,
        min_lr=training.min_lr,
        train_iters=training.train_iters,
        lr_decay_iters=training.lr_decay_iters,
        lr_warmup_iters=training.lr_warmup_iters,
        lr_warmup_fraction=training.lr_warmup_fraction,
        lr_decay_style=training.lr_decay_style,
        lr_wsd_decay_iters=training.lr_wsd_decay_iters,
        lr_wsd_decay_style=training.lr_wsd_decay_style,
        lr_warmup_init=training.lr_warmup_init,
        global_batch_size=training.global_batch_size,
    )


def decoupled_schedule_of(training: TrainingConfig) -> LRSchedule | None:
    """--decoupled-lr's schedule (the embedding and output layer's): --lr's warmup and decay
    with peak --decoupled-lr and floor --decoupled-min-lr (default --min-lr); None without it."""
    peak = training.decoupled_lr
    if peak is None:
        return None
    floor = training.min_lr if training.decoupled_min_lr is None else training.decoupled_min_lr
    _require(peak >= 0, f"--decoupled-lr must not be negative, got {peak}")
    _require(floor >= 0, f"--decoupled-min-lr must not be negative, got {floor}")
    _require(
        floor <= peak,
        f"--decoupled-min-lr ({floor}) must not exceed --decoupled-lr ({peak})"
        + (" (it defaults to --min-lr)" if training.decoupled_min_lr is None else ""),
    )
    _require(
        training.lr_warmup_init <= peak,
        f"--lr-warmup-init ({training.lr_warmup_init}) must not exceed --decoupled-lr ({peak}): "
        "both schedules warm up from it",
    )
    return dataclasses.replace(lr_schedule_of(training), max_lr=peak, min_lr=floor)
