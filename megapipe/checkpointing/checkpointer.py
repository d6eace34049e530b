"""Saving and loading a run's checkpoints with Megatron's flags and directory layout.

`SAVE/iter_0000100/` (a `torch_dist` checkpoint) and `SAVE/latest_checkpointed_iteration.txt`,
written only once the iteration directory is complete. `--load` resolves to the tracker's
iteration (or `--ckpt-step`); `--finetune` loads the weights only; `--no-load-optim`,
`--no-load-rng`, `--no-save-optim`, `--no-save-rng` leave those parts out. Random states are
restored only at the layout they were saved at (they are per rank); nothing else depends on
the layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from megapipe.checkpointing.async_save import AsyncSaver, new_saving_group
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.run_state import (
    CHECKPOINT_VERSION,
    Progress,
    after_load,
    layout_of,
    optimizer_step_count,
    restore_rng,
    rng_destinations,
    rng_shards,
    state_to_load,
    state_to_save,
)
from megapipe.checkpointing.torch_dist import load_common, load_sharded, save_sharded, sharded_keys
from megapipe.checkpointing.tracker import iteration_dir, read_tracker, write_tracker
from megapipe.config import CheckpointConfig, Configs
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.errors import ConfigError
from megapipe.parallel.initialize import default_group_timeout
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState


def checkpoint_to_load(checkpoint: CheckpointConfig) -> int | None:
    """The iteration --load (and --ckpt-step) name, or None for "start from scratch".

    ConfigError when the named checkpoint does not exist, or none does and
    --exit-on-missing-checkpoint was given."""
    if checkpoint.load is None:
        return None
    if checkpoint.ckpt_step is not None:
        directory = iteration_dir(checkpoint.load, checkpoint.ckpt_step)
        if not os.path.isdir(directory):
            raise ConfigError(f"--ckpt-step {checkpoint.ckpt_step}: {directory} does not exist")
        return checkpoint.ckpt_step
    try:
        iteration = read_tracker(checkpoint.load)
    except CheckpointError as error:
        raise ConfigError(f"--load: {error}") from None
    if iteration is None:
        if checkpoint.exit_on_missing_checkpoint:
            raise ConfigError(
                f"--load {checkpoint.load}: no checkpoint found (no "
                "latest_checkpointed_iteration.txt) and --exit-on-missing-checkpoint is set"
            )
        return None
    directory = iteration_dir(checkpoint.load, iteration)
    if not os.path.isdir(directory):
        raise ConfigError(
            f"--load {checkpoint.load}: latest_checkpointed_iteration.txt names iteration "
            f"{iteration}, but {directory} does not exist"
        )
    return iteration


def describe(layout: dict | None) -> str:
    """`TP2 x PP2 (2 virtual stages) over 8 ranks` for a saved layout record."""
    if not layout:
        return "an unknown layout"
    text = f"TP{layout['tensor_model_parallel_size']} x PP{layout['pipeline_model_parallel_size']}"
    if layout.get("virtual_pipeline_model_parallel_size", 1) > 1:
        text += f" ({layout['virtual_pipeline_model_parallel_size']} virtual stages)"
    return text + f" over {layout['world_size']} ranks"


class Checkpointer:
    """Saves and loads one run's model, optimizer, scaler, progress and random states."""

    def __init__(
        self,
        configs: Configs,
        state: ParallelState,
        chunks: Sequence[torch.nn.Module],
        optimizer: ShardedOptimizer,
        rng: RNGTracker,
    ) -> None:
        self.configs, self.state, self.chunks = configs, state, list(chunks)
        self.optimizer, self.rng = optimizer, rng
        self.checkpoint = configs.checkpoint
        self.num_layers = configs.model.num_layers
        self.layout = layout_of(state, configs.parallel.virtual_pipeline_model_parallel_size)
        self.saver: AsyncSaver | None = None
        if self.checkpoint.async_save and self.checkpoint.save is not None:
            # its own group: the background thread's collectives must not interleave with
            # the training thread's (collective: every rank builds the Checkpointer)
            group = None
            if state.world_size > 1:  # gloo, with the world's timeout (not new_group's default)
                group = new_saving_group(default_group_timeout())
            self.saver = AsyncSaver(group, state.device)

    # --- saving ---------------------------------------------------------------------------

    def save(self, progress: Progress) -> tuple[str, float]:
        """Write SAVE/iter_N and then point the tracker at it (collective). Returns the path
        and the seconds training was held up (with --async-save: staging only, the writing
        goes on in the background)."""
        if self.checkpoint.ckpt_format == "torch":  # Megatron's legacy layout (synchronous)
            from megapipe.checkpointing import legacy_torch

            return legacy_torch.save(self, progress)
        checkpoint = self.checkpoint
        assert checkpoint.save is not None
        start = time.perf_counter()
        optimizer = None if checkpoint.no_save_optim else self.optimizer
        shards = state_to_save(self.chunks, optimizer, self.state, self.num_layers)
        if not checkpoint.no_save_rng:
            shards.update(rng_shards(self.rng, self.state))
        scaler = self.optimizer.scaler
        common = {
            "checkpoint_version": CHECKPOINT_VERSION,
            **progress.as_dict(),
            "optimizer_step": optimizer_step_count(self.optimizer),
            "has_optimizer": optimizer is not None,
            "has_rng": not checkpoint.no_save_rng,
            "loss_scaler": scaler.state_dict() if scaler is not None else {},
            "layout": self.layout,
            "args": dict(self.configs.arguments),
        }
        directory = iteration_dir(checkpoint.save, progress.iteration)
        coordinator = self.state.rank == 0

        def point_tracker() -> None:
            if coordinator:
                write_tracker(checkpoint.save, progress.iteration)

        if self.saver is not None:
            self.saver.save(directory, shards, common, coordinator=coordinator, then=point_tracker)
            return directory, time.perf_counter() - start
        save_sharded(directory, shards, common, group=self.state.world.pg, coordinator=coordinator)
        point_tracker()
        if self.state.world_size > 1:
            torch.distributed.barrier(group=self.state.world.pg)
        return directory, time.perf_counter() - start

    def finish(self) -> None:
        """Wait for a save still in flight (--async-save); raise its error if it failed."""
        if self.saver is not None:
            self.saver.wait()

    # --- loading --------------------------------------------------------------------------

    def load(self) -> tuple[Progress | None, list[str]]:
        """Load what --load names into the live run; (progress to continue from, or None to
        start from scratch; notes for the user)."""
        from megapipe.checkpointing import legacy_torch

        if legacy_torch.wanted(self.checkpoint):  # by what is on disk
            return legacy_torch.load(self)
        checkpoint = self.checkpoint
        iteration = checkpoint_to_load(checkpoint)
        if iteration is None:
            return None, []
        directory = iteration_dir(checkpoint.load, iteration)
        common = load_common(directory)
        notes = [f"loading checkpoint from {directory} at iteration {iteration}"]
        weights_only = checkpoint.finetune
        with_optimizer = not (weights_only or checkpoint.no_load_optim)
        if with_optimizer and not common.get("has_optimizer", False):
            notes.append(f"{directory} holds no optimizer state: the optimizer starts afresh")
            with_optimizer = False
        optimizer = self.optimizer if with_optimizer else None
        shards = state_to_load(self.chunks, optimizer, self.state, self.num_layers)
        available = sharded_keys(directory)
        masters = [k for k in shards if k.startswith("optimizer.state.fp32_param.")]
        masters_loaded = bool(masters) and all(k in available for k in masters)
        if masters and not masters_loaded:  # saved in fp32: the weights are the masters
            shards = {k: v for k, v in shards.items() if k not in masters}
        same_layout = common.get("layout") == self.layout
        with_rng = not (weights_only or checkpoint.no_load_rng) and common.get("has_rng", False)
        if with_rng and not same_layout:
            notes.append(
                f"random states not restored: saved at {describe(common.get('layout'))}, "
                f"loading at {describe(self.layout)} (dropout masks depend on the samples "
                "only, so training is unaffected)"
            )
            with_rng = False
        rng = rng_destinations(self.rng, self.state) if with_rng else {}
        load_sharded(directory, {**shards, **rng}, group=self.state.world.pg)
        if with_rng:
            restore_rng({k: v[0].tensor for k, v in rng.items()}, self.rng, self.state.rank)
        if optimizer is not None:
            after_load(self.optimizer, int(common["optimizer_step"]), masters_loaded)
            scaler = self.optimizer.scaler
            if scaler is not None and common.get("loss_scaler"):
                scaler.load_state_dict(common["loss_scaler"])
        else:
            after_load(self.optimizer, None, masters_loaded=False)
        if weights_only:
            return Progress(0, 0, 0, {}), notes
        return Progress.from_dict(common), notes
