"""Megatron-LM's rule for the learning-rate schedule of a resumed run, in one place.

Megatron's OptimizerParamScheduler keeps its settings in the checkpoint's `opt_param_scheduler`
entry (max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, start_wd, end_wd,
wd_incr_steps, wd_incr_style; steps in samples) beside its position (num_steps). On resuming,
each setting of the command line is compared with the checkpoint's:
`--override-opt_param-scheduler`: the command line's wins; `--use-checkpoint-opt_param-scheduler`:
the checkpoint's (the schedule continues as saved); neither: a difference is an error, so that
a resumed run never jumps to another schedule silently (a longer --train-iters stretches the
decay: the LR would leap up). megapipe records --decoupled-lr's peak and floor in the same entry,
under the same rule. `--finetune` starts a fresh schedule (no check); a checkpoint saved before
megapipe recorded the settings loads with the command line's, unchecked, and a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megapipe.config import CheckpointConfig
from megapipe.errors import ConfigError

MEGATRON_SETTINGS = (
    "max_lr",
    "min_lr",
    "lr_warmup_steps",
    "lr_decay_steps",
    "lr_decay_style",
    "start_wd",
    "end_wd",
    "wd_incr_steps",
    "wd_incr_style",
)
DECOUPLED_SETTINGS = ("decoupled_lr", "decoupled_min_lr")  # megapipe's (None: not decoupled)
SETTINGS = MEGATRON_SETTINGS + DECOUPLED_SETTINGS
STEPS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")  # counted in samples
OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"


@dataclass(frozen=True)
class ScheduleSettings:
    """One run's schedule settings under Megatron's names (steps in samples), and the flag
    that sets each (for messages)."""

    values: dict[str, object]  # SETTINGS -> value
    flags: dict[str, str]  # SETTINGS -> the flag a user changes
    global_batch_size: int  # samples per iteration, to say what the steps count
    train_iters: int  # the run's length: a checkpoint at or past it trains nothing, unchecked


def saved_settings(entry: object) -> dict[str, object] | None:
    """The settings an `opt_param_scheduler` entry holds; None for a checkpoint saved
    before megapipe recorded them (or an entry that is not Megatron's)."""
    if not isinstance(entry, dict) or any(key not in entry for key in MEGATRON_SETTINGS):
        return None
    return {key: entry.get(key) for key in SETTINGS}


def _same(a: object, b: object) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)
    return a == b


def _differences(here: ScheduleSettings, saved: dict[str, object]) -> list[str]:
    """`--flag: key HERE here, SAVED in the checkpoint` for every setting that differs."""
    return [
        f"{here.flags[key]}: {key} {here.values[key]} here, {saved[key]} in the checkpoint"
        for key in SETTINGS
        if not _same(here.values[key], saved[key])
    ]


def _unit(here: ScheduleSettings, saved: dict[str, object]) -> str:
    """What the steps count, when a step setting is among the differences."""
    if any(not _same(here.values[key], saved[key]) for key in STEPS):
        return f" (steps count samples: iterations x --global-batch-size {here.global_batch_size})"
    return ""


def settle(
    here: ScheduleSettings,
    saved: dict[str, object] | None,
    checkpoint: CheckpointConfig,
    where: str,
) -> tuple[dict[str, object], str | None]:
    """The settings a run resumed from `where` follows, and a note for the user (or None).

    ConfigError, in one line naming the flags, both values and the two options, when they
    differ and neither option was given (Megatron's assertion)."""
    if saved is None:
        return here.values, (
            f"{where} records no learning-rate schedule settings (saved before megapipe kept "
            "Megatron's opt_param_scheduler values): the command line's schedule is used, "
            "unchecked"
        )
    differences = _differences(here, saved)
    if not differences:
        return saved, None
    listed = "; ".join(differences) + _unit(here, saved)
    if checkpoint.override_opt_param_scheduler:
        return here.values, f"{OVERRIDE}: following the command line's schedule: {listed}"
    if checkpoint.use_checkpoint_opt_param_scheduler:
        if saved["decoupled_lr"] is not None and here.values["decoupled_lr"] is None:
            raise ConfigError(
                f"{USE_CHECKPOINT}: the checkpoint {where} gives the embedding and output layer "
                f"--decoupled-lr {saved['decoupled_lr']}: add --decoupled-lr (any value; the "
                "checkpoint's is used) so that they get optimizer groups of their own"
            )
        return saved, f"{USE_CHECKPOINT}: continuing the checkpoint's schedule: {listed}"
    raise ConfigError(
        f"the learning-rate schedule differs from the one checkpoint {where} was saved with: "
        f"{listed}; add {OVERRIDE} to follow the command line's, or {USE_CHECKPOINT} to "
        "continue the checkpoint's"
    )
