"""Saving and loading a run's checkpoints with Megatron's flags and directory layout.

`SAVE/iter_0000100/` and `SAVE/latest_checkpointed_iteration.txt`, written only once the
iteration directory is complete. `--ckpt-format` chooses what saves write (`torch_dist`, or
Megatron's legacy `torch` layout); loads go by what is on disk. `--load` resolves to the
tracker's iteration (or `--ckpt-step`, `tracker.checkpoint_to_load`); what is restored
(`--finetune`: the weights only; `--no-load-optim`, `--no-load-rng`; random states only at the
layout they were saved at) is `load_plan`'s decision for both formats; `--no-save-optim`,
`--no-save-rng` leave those parts out of a save.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from megapipe.checkpointing import legacy_torch
from megapipe.checkpointing.async_save import AsyncSaver, new_saving_group
from megapipe.checkpointing.layout_free import fit_vocabulary, stacks_layers
from megapipe.checkpointing.load_plan import Held, LoadPlan, Request, plan_load
from megapipe.checkpointing.megatron_args import megatron_namespace
from megapipe.checkpointing.run_state import (
    CHECKPOINT_VERSION,
    LiveRun,
    Progress,
    after_load,
    extra_state_to_save,
    layout_of,
    optimizer_step_count,
    restore_rng,
    rng_destinations,
    rng_shards,
    state_to_load,
    state_to_save,
)
from megapipe.checkpointing.scheduler_rule import ScheduleSettings
from megapipe.checkpointing.torch_dist import load_common, load_sharded, save_sharded, sharded_keys
from megapipe.checkpointing.tracker import checkpoint_to_load, iteration_dir, point_tracker
from megapipe.config import Configs
from megapipe.console import say
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.parallel.initialize import default_group_timeout
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState


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
        self.stacked = stacks_layers(configs.model)  # Megatron-Core's naming of the layers
        self.layout = layout_of(state, configs.parallel.virtual_pipeline_model_parallel_size)
        self.saver: AsyncSaver | None = None
        if self.checkpoint.async_save and self.checkpoint.save is not None:
            # its own group: the background thread's collectives must not interleave with
            # the training thread's (collective: every rank builds the Checkpointer)
            group = None
            if state.world_size > 1:  # gloo, with the world's timeout (not new_group's default)
                group = new_saving_group(default_group_timeout())
            self.saver = AsyncSaver(group, state.device)

    @property
    def run(self) -> LiveRun:
        """The live parts a checkpoint saves and restores."""
        return LiveRun(self.state, self.chunks, self.optimizer, self.rng, self.layout)

    # --- saving ---------------------------------------------------------------------------

    def save(self, progress: Progress) -> tuple[str, float]:
        """Write SAVE/iter_N and then point the tracker at it (collective). Returns the path
        and the seconds training was held up (with --async-save: staging only, the writing
        goes on in the background)."""
        checkpoint = self.checkpoint
        assert checkpoint.save is not None
        start = time.perf_counter()
        directory = iteration_dir(checkpoint.save, progress.iteration)
        coordinator = self.state.rank == 0

        def then() -> None:  # rank 0, once the iteration directory is in place
            if coordinator:
                warning = point_tracker(checkpoint.save, progress.iteration)
                if warning is not None:
                    say(f"warning: {warning}")

        namespace = megatron_namespace(
            self.configs,
            iteration=progress.iteration,
            consumed_train_samples=progress.consumed_samples,
        )
        if checkpoint.ckpt_format == "torch":  # Megatron's legacy layout (synchronous)
            contents = legacy_torch.SaveContents(
                progress,
                with_optimizer=not checkpoint.no_save_optim,
                with_rng=not checkpoint.no_save_rng,
                args=dict(self.configs.arguments),
                true_vocab_size=self.configs.model.vocab_size,
                megatron_args=namespace,
            )
            legacy_torch.save(self.run, directory, contents, then=then)
            return os.path.abspath(directory), time.perf_counter() - start
        optimizer = None if checkpoint.no_save_optim else self.optimizer
        shards = state_to_save(
            self.chunks,
            optimizer,
            self.state,
            self.num_layers,
            model_owner=self.optimizer,
            stacked=self.stacked,
        )
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
            "args": namespace,  # Megatron-LM's; megapipe reads its own strings
            "megapipe_args": dict(self.configs.arguments),
            "true_vocab_size": self.configs.model.vocab_size,
        }
        objects = extra_state_to_save(
            self.chunks, self.state, self.num_layers, stacked=self.stacked
        )
        if self.saver is not None:
            self.saver.save(
                directory, shards, common, coordinator=coordinator, then=then, objects=objects
            )
            return directory, time.perf_counter() - start
        save_sharded(
            directory,
            shards,
            common,
            group=self.state.world.pg,
            coordinator=coordinator,
            objects=objects,
        )
        then()
        if self.state.world_size > 1:
            torch.distributed.barrier(group=self.state.world.pg)
        return directory, time.perf_counter() - start

    def finish(self) -> None:
        """Wait for a save still in flight (--async-save); raise its error if it failed."""
        if self.saver is not None:
            self.saver.wait()

    # --- loading --------------------------------------------------------------------------

    def load(self, schedule: ScheduleSettings | None = None) -> tuple[Progress | None, list[str]]:
        """Load what --load names into the live run; (progress to continue from, or None to
        start from scratch; notes for the user). The format is whatever is on disk.
        `schedule`: the run's LR schedule settings, checked against the checkpoint's
        (`load_plan`); the progress then carries the settings to continue with."""
        checkpoint = self.checkpoint
        iteration = checkpoint_to_load(checkpoint)
        if iteration is None:
            return None, []
        assert checkpoint.load is not None
        directory = iteration_dir(checkpoint.load, iteration)
        if legacy_torch.is_legacy(directory):
            directory = os.path.abspath(directory)
            data = legacy_torch.read_model(self.run, directory, Request.of(checkpoint).optimizer)
            held = Held.of(data)
            plan = plan_load(checkpoint, directory, iteration, held, self.layout, schedule)
            legacy_torch.restore(self.run, directory, data, optimizer=plan.optimizer, rng=plan.rng)
            saved = Progress.from_dict(data["opt_param_scheduler"])
        else:
            common = load_common(directory)
            held = Held.of(common)
            plan = plan_load(checkpoint, directory, iteration, held, self.layout, schedule)
            self._load_torch_dist(plan, common)
            saved = Progress.from_dict(common)
        return plan.progress(saved), list(plan.notes)

    def _load_torch_dist(self, plan: LoadPlan, common: dict) -> None:
        """Restore a torch_dist checkpoint as `plan` says (collective)."""
        optimizer = self.optimizer if plan.optimizer else None
        shards = state_to_load(
            self.chunks, optimizer, self.state, self.num_layers, stacked=self.stacked
        )
        available = sharded_keys(plan.directory)
        masters = [k for k in shards if k.startswith("optimizer.state.fp32_param.")]
        masters_loaded = bool(masters) and all(k in available for k in masters)
        if masters and not masters_loaded:  # saved in fp32: the weights are the masters
            shards = {k: v for k, v in shards.items() if k not in masters}
        if masters_loaded and self.optimizer.masters_are_weights:  # one destination, read once
            loaded = {k.removeprefix("optimizer.state.fp32_param.") for k in masters}
            shards = {k: v for k, v in shards.items() if k not in loaded}
        rng = rng_destinations(self.rng, self.state) if plan.rng else {}
        load_sharded(
            plan.directory, {**shards, **rng}, group=self.state.world.pg, fit=fit_vocabulary
        )
        if plan.rng:
            restore_rng({k: v[0].tensor for k, v in rng.items()}, self.rng, self.state.rank)
        if optimizer is not None:
            after_load(self.optimizer, int(common["optimizer_step"]), masters_loaded)
            scaler = self.optimizer.scaler
            if scaler is not None and common.get("loss_scaler"):
                scaler.load_state_dict(common["loss_scaler"])
        else:
            after_load(self.optimizer, None, masters_loaded=False)
