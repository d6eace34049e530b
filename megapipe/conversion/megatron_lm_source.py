"""A checkpoint that Megatron-LM wrote, read into full logical tensors (a conversion `Source`).

torch_dist: the DCP keys are megapipe's logical names already (see `layout_free`), so every
model tensor is read whole, without checksums (Megatron-LM writes none; the pickles still go
through the allow-list). Legacy torch: each `mp_rank` file's TP-local state is loaded into the
matching rank's megapipe model (built at the checkpoint's TP x PP, with Megatron's stage layer
ranges), TransformerEngine's fused norm names mapped back and `_extra_state` entries dropped,
and assembled through `layout_free.model_shards` as for megapipe's own legacy files. Either
way the vocabulary tensors keep only the real rows (`MegatronRun.vocab_size`): the padding
depends on the TP size, and is rebuilt by whoever builds a model.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from megapipe.checkpointing import legacy_torch as legacy
from megapipe.checkpointing import megatron_lm
from megapipe.checkpointing.checkpointer import Checkpointer
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.layout_free import model_shards
from megapipe.checkpointing.load_plan import Held, plan_load
from megapipe.checkpointing.run_state import Progress, after_load
from megapipe.checkpointing.scheduler_rule import ScheduleSettings, saved_settings
from megapipe.checkpointing.tracker import RELEASE, checkpoint_path, checkpoint_to_load
from megapipe.config import ModelConfig
from megapipe.conversion.convert import (
    WORD_EMBEDDING,
    FullTensors,
    Say,
    Source,
    build_rank,
    fill_chunks,
    model_config_from_args,
    model_tensors,
    read_source,
    resolve,
    write_source,
)
from megapipe.errors import ConfigError
from megapipe.pipeline.partition import partition_layers

OUTPUT_LAYER = "output_layer.weight"
# TransformerEngine's fused norm names (Megatron-LM's default layer spec) -> megapipe's modules
_TE_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}


def _unfused(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        for fused, ours in _TE_NORMS.items():
            if key.endswith("." + fused):
                key = key[: -len(fused)] + ours
                break
        out[key] = value
    return out


def _legacy_tensors(
    run: megatron_lm.MegatronRun, config: ModelConfig, say: Say
) -> dict[str, torch.Tensor]:
    """Full tensors assembled from every mp_rank file of a Megatron-LM legacy checkpoint."""
    tp, pp, vp = run.tp, run.pp, run.virtual_stages
    stage_map = partition_layers(config, pp, vp)
    assembled = FullTensors()
    for p in range(pp):
        for t in range(tp):
            path = megatron_lm.legacy_file(run.directory, t, p, pp)
            states = megatron_lm.legacy_model_states(megatron_lm.load_pickle(path), path)
            ranges = list(stage_map.layers[p])
            if len(states) != len(ranges):
                raise CheckpointError(
                    f"checkpoint file {path}: {len(states)} model chunks, the args' virtual "
                    f"pipeline size says {len(ranges)}"
                )
            chunks = build_rank(config, t, tp, p, ranges, pp)
            for i, (chunk, state) in enumerate(zip(chunks, states)):
                chunk.to(next(iter(state.values())).dtype)
                legacy.load_chunk_state(chunk, _unfused(state), f"{path} [chunk {i}]")
            named = [item for chunk in chunks for item in chunk.named_parameters()]
            assembled.add(model_shards(named, t, tp, config.num_layers))
            say(f" read {os.path.relpath(path, run.directory)}")
    tensors = assembled.complete(run.directory)
    return tensors


def read_megatron_lm(
    directory: str, release: bool = False, say: Say = print
) -> tuple[Source, megatron_lm.MegatronRun]:
    """A Megatron-LM checkpoint directory as full tensors with the real vocabulary rows, and
    what it says about its run."""
    run = megatron_lm.read_run(directory, release)
    config = model_config_from_args(run.args, run.vocab_size)
    if run.format == "torch_dist":
        tensors = model_tensors(run.directory, run.vocab_size, require_checksums=False)
    else:
        tensors = _legacy_tensors(run, config, say)
    if WORD_EMBEDDING not in tensors:
        raise CheckpointError(f"checkpoint {run.directory}: no {WORD_EMBEDDING}")
    for name in (WORD_EMBEDDING, OUTPUT_LAYER):
        if name in tensors:
            rows = tensors[name].shape[0]
            if rows < run.vocab_size:
                raise CheckpointError(
                    f"checkpoint {run.directory}: tensor {name} has {rows} rows, fewer than the "
                    f"vocabulary's {run.vocab_size}"
                )
            tensors[name] = tensors[name][: run.vocab_size].contiguous()
    source = Source(run.directory, run.format, tensors, run.args, run.progress, config)
    return source, run


def read_any(directory: str, release: bool = False, say: Say = print) -> Source:
    """A checkpoint iteration directory that megapipe or Megatron-LM wrote, as full tensors."""
    if megatron_lm.is_megatron_lm(directory):
        say(f" {directory}: written by Megatron-LM ({'release, ' if release else ''}weights)")
        source, run = read_megatron_lm(directory, release, say)
        for note in run.notes:
            say(f" note: {note}")
        return source
    return read_source(directory, say)


def convert_any(load_dir: str, save_dir: str, tp: int, pp: int, fmt: str, say: Say = print) -> str:
    """`convert.convert` for a checkpoint of either origin (a Megatron-LM `release` one is
    written as iteration 0)."""
    directory, iteration = resolve(load_dir)
    say(f" reading {directory} (model weights only: the optimizer state is dropped)")
    source = read_any(directory, iteration == RELEASE, say)
    return write_source(source, save_dir, tp, pp, fmt, max(iteration, 0), say)


# ModelConfig fields that must agree between the run and the checkpoint it loads weights from
# (the others, dropout and init, do not change what the weights mean)
_SHAPE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "head_dim", "qk_layernorm", "position_embedding_type", "rotary_base", "rotary_percent",
    "normalization", "layernorm_epsilon", "swiglu", "openai_gelu", "squared_relu",
    "apply_residual_connection_post_layernorm", "untie_embeddings_and_output_weights",
    "add_bias_linear", "vocab_size",
)  # fmt: skip


def _check_model(run_model: ModelConfig, saved: ModelConfig, where: str) -> None:
    differ = [
        f"{name} {getattr(run_model, name, None)!r} here, {getattr(saved, name, None)!r} there"
        for name in _SHAPE_FIELDS
        if getattr(run_model, name, None) != getattr(saved, name, None)
    ]
    if differ:
        raise ConfigError(
            f"--load {where}: the model differs from the one Megatron-LM saved ("
            + "; ".join(differ)
            + "): pass the checkpoint's model flags, or --use-checkpoint-args to take them from it"
        )


def load_megatron_lm(
    checkpoints: Checkpointer, schedule: ScheduleSettings | None = None
) -> tuple[Progress, list[str]] | None:
    """When --load names a checkpoint that Megatron-LM wrote: its weights into the live run at
    this run's layout (every rank reads the whole model and keeps its pieces), and where
    training continues: with --finetune, or from a `release` checkpoint, at iteration 0;
    otherwise at the saved iteration, consumed samples and LR schedule (Megatron's rule
    between the command line's schedule and the saved one applies, `load_plan`). The optimizer
    state is not restored: Megatron-LM stores it as flat per-data-parallel-rank buckets
    (`distrib_optim.pt`, torch_dist's `dp_reshardable` form) or in the order of its own
    parameter groups, neither of which maps onto megapipe's parameters; Adam starts afresh, as
    after --no-load-optim. Random states are not restored either (dropout here does not depend
    on them). None when --load names no checkpoint, or one that megapipe wrote."""
    checkpoint = checkpoints.checkpoint
    iteration = checkpoint_to_load(checkpoint)
    if iteration is None or checkpoint.load is None:
        return None
    directory = os.path.abspath(checkpoint_path(checkpoint.load, iteration))
    if not megatron_lm.is_megatron_lm(directory):
        if iteration == RELEASE:
            raise ConfigError(
                f"--load {checkpoint.load}: its tracker says release, but {directory} is not a "
                "checkpoint Megatron-LM wrote"
            )
        return None
    release = iteration == RELEASE
    source, run = read_megatron_lm(directory, release, say=lambda _: None)
    _check_model(checkpoints.configs.model, source.config, directory)
    state = checkpoints.state
    fill_chunks(checkpoints.chunks, source, state.tp_rank, state.tp.size)
    after_load(checkpoints.optimizer, None, masters_loaded=False)  # masters from the weights
    request = dataclasses.replace(checkpoint, finetune=True) if release else checkpoint
    # Megatron-LM saves an optimizer state (not read here, above): its schedule is continued
    # and checked as a megapipe checkpoint's would be (plan.optimizer itself goes unused)
    held = Held(True, False, None, saved_settings(run.scheduler))
    plan = plan_load(request, directory, max(iteration, 0), held, checkpoints.layout, schedule)
    notes = [
        f"{directory} was written by Megatron-LM ({run.format}, TP {run.tp} x PP {run.pp}): "
        "model weights loaded"
        + (" (a release checkpoint: training starts at iteration 0)" if release else "")
        + "; its optimizer state is not read (Adam starts afresh), nor its random states",
        *run.notes,
        *plan.notes[1:],
    ]
    return plan.progress(run.progress), notes
