"""A checkpoint's model, built for generation at this job's TP x PP layout.

The model's shape comes from the arguments saved in the checkpoint, so `--load DIR` is all a
user gives. `torch_dist` checkpoints load layout-free and sharded (each rank reads only its
pieces); Megatron's legacy `torch` format, and any checkpoint Megatron-LM wrote, is read whole
on each rank and split (it is stored per saved rank, which need not be this job's). Sequence
parallelism and dropout are off: neither changes the weights, and one-token steps cannot split
a sequence.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.checkpointing import legacy_torch, megatron_lm
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.layout_free import (
    checkpointed_tensors,
    fit_vocabulary,
    model_shards,
    saved_vocab_size,
    stacks_layers,
)
from megapipe.checkpointing.megatron_args import saved_arguments
from megapipe.checkpointing.torch_dist import load_common, load_sharded, read_metadata
from megapipe.checkpointing.tracker import RELEASE_NAME, iteration_dir, saved_listing
from megapipe.config import ModelConfig
from megapipe.conversion.convert import (
    WORD_EMBEDDING,
    _fill,
    check_target,
    model_config_from_args,
    read_legacy,
    resolve,
)
from megapipe.conversion.megatron_lm_source import read_megatron_lm
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState

Say = Callable[[str], None]


@dataclass
class InferenceModel:
    """This rank's pipeline stage of a loaded model, in eval mode."""

    config: ModelConfig
    state: ParallelState
    model: GPTModel
    args: dict[str, str]  # the saved run's arguments (its tokenizer flags among them)
    directory: str  # the iteration directory loaded
    dtype: torch.dtype

    @property
    def context_length(self) -> int:
        """Positions the model can attend over: the learned table's size, or with rotary
        positions the larger of --seq-length and --max-position-embeddings."""
        config = self.config
        if config.position_embedding_type == "learned_absolute":
            return config.max_position_embeddings
        return max(config.seq_length, config.max_position_embeddings)


def checkpoint_directory(load_dir: str, ckpt_step: int | None = None) -> str:
    """The iteration directory `--load` (and `--ckpt-step`) name; CheckpointError if none."""
    if ckpt_step is None:
        return resolve(load_dir, "--load")[0]
    directory = iteration_dir(load_dir, ckpt_step)
    if not os.path.isdir(directory):
        raise CheckpointError(
            f"--ckpt-step {ckpt_step}: {directory} does not exist ({saved_listing(load_dir)})"
        )
    return directory


def load_inference_model(
    load_dir: str,
    state: ParallelState,
    *,
    ckpt_step: int | None = None,
    dtype: torch.dtype | None = None,
    say: Say = lambda _: None,
) -> InferenceModel:
    """Build this rank's stage of the checkpoint's model and load its weights (collective over
    the job). dtype: the compute dtype (default: the dtype the weights were saved in)."""
    if state.dp_cp.size != 1:
        raise CheckpointError(
            f"generation runs on TP x PP ranks only: the job has {state.world_size} ranks, "
            f"TP {state.tp.size} x PP {state.pp.size} uses {state.tp.size * state.pp.size}"
        )
    directory = checkpoint_directory(load_dir, ckpt_step)
    source = None
    if megatron_lm.is_megatron_lm(directory):  # read whole, real vocabulary rows only
        release = os.path.basename(os.path.normpath(directory)) == RELEASE_NAME
        source, _ = read_megatron_lm(directory, release, say)
        config, args = source.config, source.args
        saved_dtype = source.tensors[WORD_EMBEDDING].dtype
    elif legacy_torch.is_legacy(directory):
        source = read_legacy(directory, say)
        config, args = source.config, source.args
        saved_dtype = source.tensors[WORD_EMBEDDING].dtype
    else:
        common = load_common(directory)
        args = saved_arguments(common)
        held = read_metadata(directory).state_dict_metadata
        if WORD_EMBEDDING not in held:
            raise CheckpointError(f"checkpoint {directory}: no {WORD_EMBEDDING}")
        saved = {k: tuple(md.size) for k, md in held.items() if hasattr(md, "size")}
        config = model_config_from_args(args, saved_vocab_size(common, saved))
        saved_dtype = held[WORD_EMBEDDING].properties.dtype
    ranges = check_target(config, state.tp.size, state.pp.size)
    rng = RNGTracker(1234, state.tp_rank, state.pp_rank, state.device)
    model = GPTModel(config, state, rng, seed=1234, layers=ranges[state.pp.rank])
    model.to(saved_dtype)
    if source is not None:
        _fill([model], source, state.tp_rank, state.tp.size)
    else:
        named = checkpointed_tensors(model)  # the routers' expert biases too
        wanted = model_shards(
            named,
            state.tp_rank,
            state.tp.size,
            config.num_layers,
            loading=True,
            stacked=stacks_layers(config),
        )
        load_sharded(directory, wanted, group=state.world.pg, fit=fit_vocabulary)
    dtype = dtype or saved_dtype
    model.to(dtype)
    model.eval()
    say(f"loaded {directory} (TP {state.tp.size} x PP {state.pp.size}, {dtype})")
    return InferenceModel(config, state, model, args, directory, dtype)
