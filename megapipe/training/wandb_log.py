"""Weights & Biases as a second backend of the run's scalar writer (--wandb-project).

Megatron-LM logs to W&B, from one rank, the scalars it writes to TensorBoard, each at its
iteration, with the run's arguments as the W&B config. Here the same `TrainingTensorBoard`
writes both, so the list of scalars lives in one place; this module only adapts W&B's
`run.log` to the `ScalarBackend` interface. W&B has one x axis (the step, here the iteration):
instead of TensorBoard's `<tag> vs samples` series it gets Megatron's `samples vs steps`.

The wandb package is optional (`pip install wandb`); the flags' validation refuses
--wandb-project without it, and it is imported only here, only when a run asks for it.
WANDB_MODE=offline writes the run under the save directory without an account or network.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from megapipe.config import Configs


class WandbBackend:
    """One W&B run: `wandb.init` at construction, `finish` at close."""

    def __init__(
        self, project: str, name: str, save_dir: str | None, config: Mapping[str, object]
    ) -> None:
        import wandb  # optional: only a run with --wandb-project gets here

        if save_dir is not None:
            os.makedirs(save_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=save_dir, config=dict(config))

    def scalar(self, tag: str, value: float, iteration: int) -> None:
        self.run.log({tag: value}, step=iteration)

    def scalar_vs_samples(
        self, tag: str, value: float, iteration: int, consumed_samples: int
    ) -> None:
        self.run.log({"samples vs steps": consumed_samples}, step=iteration)

    def text(self, tag: str, text: str, step: int) -> None:
        """Nothing: the arguments are the run's W&B config already."""

    def flush(self) -> None:
        """Nothing: W&B sends in the background and on `finish`."""

    def close(self) -> None:
        self.run.finish()


def wandb_save_dir(configs: Configs) -> str | None:
    """--wandb-save-dir, else SAVE/wandb with --save (as Megatron), else None (wandb's ./wandb)."""
    logging = configs.logging
    if logging.wandb_save_dir is not None:
        return logging.wandb_save_dir
    save = configs.checkpoint.save
    return os.path.join(save, "wandb") if save is not None else None


def wandb_maker(configs: Configs) -> Callable[[], WandbBackend] | None:
    """What opens the W&B run on the writing rank, or None without --wandb-project."""
    logging = configs.logging
    if logging.wandb_project is None:
        return None
    project, name = logging.wandb_project, logging.wandb_exp_name or ""
    return lambda: WandbBackend(project, name, wandb_save_dir(configs), dict(configs.arguments))
