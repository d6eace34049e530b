"""What a load restores, decided in one place for every checkpoint format.

The flags ask (`--finetune`: the weights only, progress restarts at 0; `--no-load-optim`,
`--no-load-rng`), the checkpoint answers what it holds (optimizer state, random states, the
layout it was saved at, the LR schedule's settings), and `plan_load` settles what is restored,
which schedule the run continues (Megatron's rule, `scheduler_rule.settle`) and the notes.
The format modules only read and write their files, as the plan says.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megapipe.checkpointing.run_state import Progress
from megapipe.checkpointing.scheduler_rule import ScheduleSettings, saved_settings, settle
from megapipe.config import CheckpointConfig


def describe(layout: dict | None) -> str:
    """`TP2 x PP2 (2 virtual stages) over 8 ranks` for a saved layout record."""
    if not layout:
        return "an unknown layout"
    text = f"TP{layout['tensor_model_parallel_size']} x PP{layout['pipeline_model_parallel_size']}"
    if layout.get("context_parallel_size", 1) > 1:
        text += f" x CP{layout['context_parallel_size']}"
    if layout.get("virtual_pipeline_model_parallel_size", 1) > 1:
        text += f" ({layout['virtual_pipeline_model_parallel_size']} virtual stages)"
    return text + f" over {layout['world_size']} ranks"


@dataclass(frozen=True)
class Request:
    """What the flags ask a load for, before the checkpoint is looked at."""

    weights_only: bool  # --finetune
    optimizer: bool
    rng: bool

    @classmethod
    def of(cls, checkpoint: CheckpointConfig) -> Request:
        weights_only = checkpoint.finetune
        return cls(
            weights_only=weights_only,
            optimizer=not (weights_only or checkpoint.no_load_optim),
            rng=not (weights_only or checkpoint.no_load_rng),
        )


@dataclass(frozen=True)
class Held:
    """What a checkpoint says it holds (its common entries, in either format)."""

    has_optimizer: bool
    has_rng: bool
    layout: dict | None  # the layout record it was saved at
    scheduler: dict | None = None  # the LR schedule's settings (None: not recorded)

    @classmethod
    def of(cls, entries: dict) -> Held:
        return cls(
            bool(entries.get("has_optimizer", False)),
            bool(entries.get("has_rng", False)),
            entries.get("layout"),
            saved_settings(entries.get("opt_param_scheduler")),
        )


@dataclass(frozen=True)
class LoadPlan:
    """What one load restores (the model's weights always), and the notes to print."""

    directory: str
    iteration: int
    weights_only: bool
    optimizer: bool  # the optimizer's state and the loss scaler's
    rng: bool  # the random states (per rank: only at the layout they were saved at)
    notes: tuple[str, ...]
    scheduler: dict | None = None  # the schedule settings to continue with (None: the saved)

    def progress(self, saved: Progress) -> Progress:
        """Where training continues: the saved progress with the settled schedule, or 0
        after --finetune (a fresh schedule)."""
        if self.weights_only:
            return Progress(0, 0, 0, {})
        if self.scheduler is None:
            return saved
        return dataclasses.replace(saved, scheduler=self.scheduler)


def _continues_schedule(
    schedule: ScheduleSettings, request: Request, held: Held, iteration: int
) -> bool:
    """Whether the saved schedule is continued (so checked): with the optimizer's state, and
    iterations left to train."""
    return request.optimizer and held.has_optimizer and iteration < schedule.train_iters


def plan_load(
    checkpoint: CheckpointConfig,
    directory: str,
    iteration: int,
    held: Held,
    layout: dict,
    schedule: ScheduleSettings | None = None,
) -> LoadPlan:
    """Settle what the load of `directory` restores into a run at `layout`, and, given the
    run's `schedule` settings, the schedule it continues (ConfigError where they differ from
    the checkpoint's and no option says which wins). As in Megatron, the schedule is part of
    the optimizer's state: --finetune, --no-load-optim and a checkpoint without optimizer
    state take the command line's unchecked (on the saved clock, unless --finetune); so does a
    checkpoint with nothing left to train."""
    request = Request.of(checkpoint)
    notes = [f"loading checkpoint from {directory} at iteration {iteration}"]
    scheduler = None
    if schedule is not None and _continues_schedule(schedule, request, held, iteration):
        scheduler, note = settle(schedule, held.scheduler, checkpoint, directory)
        notes += [note] if note else []
    optimizer = request.optimizer
    if optimizer and not held.has_optimizer:
        notes.append(f"{directory} holds no optimizer state: the optimizer starts afresh")
        optimizer = False
    rng = request.rng and held.has_rng
    if rng and held.layout != layout:
        notes.append(
            f"random states not restored: saved at {describe(held.layout)}, loading at "
            f"{describe(layout)} (dropout masks depend on the samples only, so training is "
            "unaffected)"
        )
        rng = False
    return LoadPlan(
        directory, iteration, request.weights_only, optimizer, rng, tuple(notes), scheduler
    )
