"""Rewrite a megapipe checkpoint (either format, any layout) for another layout and format.

In one process, with no process group: the source is read into full logical tensors (the
layout-free names and shapes of `layout_free`; the vocabulary tensors cut to the real rows,
whatever the source layout's padding), target-layout models are built per rank with
hand-made single-process groups, filled from the full tensors through
`layout_free.model_shards(..., loading=True)` and written (with the target layout's padding
rows, Megatron-Core's `_extra_state` entries and Megatron-LM's `args`). Model weights only,
as Megatron's converter: the optimizer and random states are dropped (the run's progress is
kept).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch

from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing import legacy_torch as legacy
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.extra_state import extra_state_entries, layer_mlps
from megapipe.checkpointing.layout_free import (
    checkpointed_tensors,
    fit_vocabulary,
    is_vocabulary,
    model_shards,
    saved_vocab_size,
    stacks_layers,
)
from megapipe.checkpointing.megatron_args import converted_namespace, saved_arguments
from megapipe.checkpointing.run_state import CHECKPOINT_VERSION, Progress
from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.checkpointing.torch_dist import (
    load_common,
    load_sharded,
    read_metadata,
    save_sharded,
)
from megapipe.checkpointing.tracker import (
    checkpoint_path,
    iteration_dir,
    read_tracker,
    write_tracker,
)
from megapipe.config import ModelConfig, MoEConfig
from megapipe.errors import ConfigError
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState
from megapipe.pipeline.partition import partition_layers

WORD_EMBEDDING = "embedding.word_embeddings.weight"
Say = Callable[[str], None]
# ModelConfig fields newer than some saved checkpoints, with the value those runs had.
ADDED_LATER = {
    "openai_gelu": False,
    "kv_channels": None,
    "qk_layernorm": False,
    "rotary_percent": 1.0,
    "squared_relu": False,
    "apply_residual_connection_post_layernorm": False,
    "moe": None,  # runs before MoE (and dense runs since) have no num_experts
}


@dataclass
class Source:
    """A checkpoint read into full logical tensors."""

    directory: str
    format: str  # "torch_dist" or "torch"
    tensors: dict[str, torch.Tensor]  # logical name -> full tensor
    args: dict[str, str]
    progress: Progress
    config: ModelConfig


def _value(text: str) -> object:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def model_config_from_args(args: dict[str, str], vocab_size: int) -> ModelConfig:
    """The ModelConfig a run with these saved arguments had (vocabulary from the weights)."""
    values = {**ADDED_LATER, **{k: _value(v) for k, v in args.items()}}
    names = {f.name for f in fields(ModelConfig)} - {"vocab_size", "num_query_groups"}
    missing = sorted(n for n in names if n not in values)
    if missing:
        raise CheckpointError(f"saved args lack {missing[:4]}: not a megapipe checkpoint?")
    kwargs = {n: values[n] for n in names}
    kwargs["moe"] = _moe_config(values)
    groups = None
    if values.get("group_query_attention"):
        groups = values.get("num_query_groups") or 1
    return ModelConfig(vocab_size=vocab_size, num_query_groups=groups, **kwargs)


def _moe_config(values: dict[str, object]) -> MoEConfig | None:
    """The MoEConfig of saved arguments (its fields are the flags' names), None without
    --num-experts."""
    if values.get("num_experts") is None:
        return None
    kwargs = {f.name: values[f.name] for f in fields(MoEConfig) if f.name in values}
    freq = kwargs.get("moe_layer_freq", 1)
    if isinstance(freq, str):  # the flag's text: "2" or "[1,0,1,0]"
        freq = _value(freq)
    kwargs["moe_layer_freq"] = tuple(freq) if isinstance(freq, list) else freq
    return MoEConfig(**kwargs)


def resolve(load_dir: str, flag: str = "--load-dir") -> tuple[str, int]:
    """(iteration directory, iteration) the tracker of `load_dir` names; errors name `flag`
    (the calling tool's name for it: --load-dir here, --load for the generation tools)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{flag} {load_dir}: no such directory")
    iteration = read_tracker(load_dir)
    if iteration is None:
        raise CheckpointError(f"{flag} {load_dir}: no latest_checkpointed_iteration.txt")
    directory = checkpoint_path(load_dir, iteration)  # iter_N, or release/ for RELEASE
    if not os.path.isdir(directory):
        raise CheckpointError(f"{flag} {load_dir}: {directory} does not exist")
    return directory, iteration


def _is_model_key(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state"))


def model_tensors(
    directory: str, vocab: int, *, require_checksums: bool = True
) -> dict[str, torch.Tensor]:
    """Every model tensor of a torch_dist checkpoint (megapipe's or Megatron-LM's: the same
    keys), whole, in its saved dtype; vocabulary tensors cut to `vocab` rows. Optimizer and
    random states and byte entries (`_extra_state`) are left out."""
    held = read_metadata(directory, require_checksums=require_checksums).state_dict_metadata
    tensors, shards = {}, {}
    for key, md in held.items():
        if not _is_model_key(key) or not hasattr(md, "size"):
            continue
        shape = tuple(md.size)
        if is_vocabulary(key):
            shape = (vocab, *shape[1:])
        tensor = torch.empty(shape, dtype=md.properties.dtype)
        tensors[key] = tensor
        shards[key] = [TensorShard(tensor, (0,) * tensor.dim(), shape)]
    load_sharded(
        directory, shards, group=None, fit=fit_vocabulary, require_checksums=require_checksums
    )
    return tensors


def read_torch_dist(directory: str) -> Source:
    """Every model tensor of a torch_dist checkpoint, whole, in its saved dtype (vocabulary
    tensors without the saving layout's padding rows)."""
    common = load_common(directory)
    held = read_metadata(directory).state_dict_metadata
    saved = {k: tuple(md.size) for k, md in held.items() if hasattr(md, "size")}
    if WORD_EMBEDDING not in saved:
        raise CheckpointError(f"checkpoint {directory}: no {WORD_EMBEDDING}")
    vocab = saved_vocab_size(common, saved)
    tensors = model_tensors(directory, vocab)
    args = saved_arguments(common)
    config = model_config_from_args(args, vocab)
    return Source(directory, "torch_dist", tensors, args, Progress.from_dict(common), config)


def single_process_state(tp_rank: int, tp: int, pp_rank: int, pp: int) -> ParallelState:
    """The ParallelState of rank (tp_rank, pp_rank) of a TP x PP layout (DP 1), with groups
    that have members but no process group: enough to build and fill that rank's model."""
    rank = tp_rank + tp * pp_rank
    tp_group = Group(tuple(t + tp * pp_rank for t in range(tp)), tp_rank)
    pp_group = Group(tuple(tp_rank + tp * p for p in range(pp)), pp_rank)
    world = Group(tuple(range(tp * pp)), rank)
    ends = sorted({pp_group.ranks[0], pp_group.ranks[-1]})
    embedding = Group(tuple(ends), ends.index(rank)) if rank in ends else None
    return ParallelState(
        world_size=tp * pp,
        rank=rank,
        world=world,
        tp=tp_group,
        pp=pp_group,
        dp=Group.single(rank),
        model_parallel=world,
        embedding=embedding,
        device=torch.device("cpu"),
    )


def build_rank(
    config: ModelConfig, tp_rank: int, tp: int, pp_rank: int, layer_ranges: list[range], pp: int
) -> list[GPTModel]:
    """The model chunks of one rank of a TP x PP layout, in one process."""
    state = single_process_state(tp_rank, tp, pp_rank, pp)
    rng = RNGTracker(1234, tp_rank, pp_rank, state.device)
    return [GPTModel(config, state, rng, seed=1234, layers=layers) for layers in layer_ranges]


def _named(chunks: list[GPTModel]) -> list[tuple[str, torch.Tensor]]:
    """What checkpoints hold of the chunks: parameters and routers' expert biases."""
    return [item for chunk in chunks for item in checkpointed_tensors(chunk)]


def _legacy_files(directory: str) -> Iterator[tuple[int, int, str, dict]]:
    names = sorted(n for n in os.listdir(directory) if n.startswith("mp_rank_"))
    first = legacy.read_verified(os.path.join(directory, names[0]), legacy.MODEL_FILE)
    layout = first.get("layout", {})
    tp, pp = layout.get("tensor_model_parallel_size"), layout.get("pipeline_model_parallel_size")
    if not isinstance(tp, int) or not isinstance(pp, int):
        raise CheckpointError(f"checkpoint {directory}/{names[0]}: no megapipe layout entry")
    expected = sorted(legacy.mp_rank_name(t, p, pp) for t in range(tp) for p in range(pp))
    if names != expected:
        raise CheckpointError(
            f"checkpoint {directory}: holds {names}, its TP {tp} x PP {pp} layout needs {expected}"
        )
    for p in range(pp):
        for t in range(tp):
            sub = os.path.join(directory, legacy.mp_rank_name(t, p, pp))
            data = first if (t, p) == (0, 0) else legacy.read_verified(sub, legacy.MODEL_FILE)
            if data.get("layout") != layout:
                raise CheckpointError(
                    f"checkpoint file {sub}/{legacy.MODEL_FILE}: layout {data.get('layout')} "
                    f"differs from {names[0]}'s {layout}"
                )
            yield t, p, sub, data


def read_legacy(directory: str, say: Say = print) -> Source:
    """Full tensors assembled from every mp_rank file, through each rank's model."""
    assembled = FullTensors()
    first = None
    for t, p, sub, data in _legacy_files(directory):
        first = first or data
        config = model_config_from_args(saved_arguments(data), int(data["true_vocab_size"]))
        layout = data["layout"]
        ranges = [range(a, b) for a, b in data["layer_ranges"]]
        source_tp = layout["tensor_model_parallel_size"]
        chunks = build_rank(config, t, source_tp, p, ranges, layout["pipeline_model_parallel_size"])
        dtype = next(iter(data[legacy.model_key(0, len(chunks))].values())).dtype
        for i, chunk in enumerate(chunks):
            chunk.to(dtype)
            key = legacy.model_key(i, len(chunks))
            if key not in data:
                raise CheckpointError(f"checkpoint file {sub}/{legacy.MODEL_FILE}: no {key!r}")
            legacy.load_chunk_state(chunk, data[key], f"{sub}/{legacy.MODEL_FILE} [{key}]")
        pieces = model_shards(
            _named(chunks), t, source_tp, config.num_layers, stacked=stacks_layers(config)
        )
        assembled.add(pieces)
        say(f" read {os.path.basename(sub)}: {len(pieces)} tensors")
    tensors = assembled.complete(directory)
    for name, full in tensors.items():
        if is_vocabulary(name):  # the source layout's padding rows are not the model's
            tensors[name] = full[: config.vocab_size]
    assert first is not None
    progress = Progress.from_dict(first["opt_param_scheduler"])
    return Source(directory, "torch", tensors, saved_arguments(first), progress, config)


def region_of(full: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    """The view of a full logical tensor that `shard` covers."""
    view = full
    for dim, (start, size) in enumerate(zip(shard.offsets, shard.tensor.shape)):
        view = view.narrow(dim, start, size)
    return view


class FullTensors:
    """Full logical tensors assembled from the pieces of every saved rank (each element once)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._filled: dict[str, int] = {}

    def add(self, pieces: ShardedState) -> None:
        for name, shards in pieces.items():
            for shard in shards:
                full = self.tensors.get(name)
                if full is None:
                    full = torch.empty(shard.global_shape, dtype=shard.tensor.dtype)
                    self.tensors[name] = full
                region_of(full, shard).copy_(shard.tensor)
                self._filled[name] = self._filled.get(name, 0) + shard.tensor.numel()

    def complete(self, directory: str) -> dict[str, torch.Tensor]:
        """The tensors; CheckpointError naming one that the rank files did not fill."""
        for name, full in self.tensors.items():
            if self._filled[name] != full.numel():
                raise CheckpointError(
                    f"checkpoint {directory}: tensor {name}: the mp_rank files hold "
                    f"{self._filled[name]} of its {full.numel()} elements"
                )
        return self.tensors


def read_source(directory: str, say: Say = print) -> Source:
    """A checkpoint iteration directory of either format, as full tensors."""
    if legacy.is_legacy(directory):
        return read_legacy(directory, say)
    return read_torch_dist(directory)


def check_target(config: ModelConfig, tp: int, pp: int) -> list[range]:
    """The target's stage ranges (one chunk per rank); ConfigError when it cannot split."""
    sizes = [
        ("--num-attention-heads", config.num_attention_heads),
        ("--num-query-groups", config.num_query_groups),
        ("--ffn-hidden-size", config.ffn_hidden_size),
    ]
    if config.moe is not None:
        sizes.append(("--moe-ffn-hidden-size", config.moe_ffn_hidden_size))
        shared = config.moe.moe_shared_expert_intermediate_size
        if shared is not None:
            sizes.append(("--moe-shared-expert-intermediate-size", shared))
    for what, value in sizes:
        if value % tp:
            raise ConfigError(
                f"--target-tensor-parallel-size {tp} does not divide the model's {what} ({value})"
            )
    if tp < 1 or pp < 1:
        raise ConfigError(f"target sizes must be positive, got TP {tp} x PP {pp}")
    stage_map = partition_layers(config, pp, 1)
    return [chunks[0] for chunks in stage_map.layers]


def target_args(args: dict[str, str], tp: int, pp: int, fmt: str) -> dict[str, str]:
    """The saved arguments, with the layout and format of the converted checkpoint."""
    out = dict(args)
    out.update(
        tensor_model_parallel_size=repr(tp),
        pipeline_model_parallel_size=repr(pp),
        num_layers_per_virtual_pipeline_stage=repr(None),
        num_virtual_stages_per_pipeline_rank=repr(None),
        ckpt_format=repr(fmt),
    )
    return out


def fill_chunks(chunks: list[GPTModel], source: Source, tp_rank: int, tp: int) -> None:
    """Copy the source's full tensors into model chunks in place (each its own pieces)."""
    config = source.config
    wanted = model_shards(
        _named(chunks), tp_rank, tp, config.num_layers, loading=True, stacked=stacks_layers(config)
    )
    with torch.no_grad():
        for name, shards in wanted.items():
            full = source.tensors.get(name)
            if full is None:
                raise CheckpointError(f"checkpoint {source.directory}: tensor {name} is missing")
            for shard in shards:
                if tuple(full.shape) != tuple(shard.global_shape):
                    raise CheckpointError(
                        f"checkpoint {source.directory}: tensor {name} has shape "
                        f"{tuple(full.shape)}, the target model's is {shard.global_shape}"
                    )
                shard.tensor.copy_(region_of(full, shard))


def _fill(chunks: list[GPTModel], source: Source, tp_rank: int, tp: int) -> None:
    """fill_chunks, the chunks first cast to the source's dtype (a conversion keeps it)."""
    dtype = source.tensors[WORD_EMBEDDING].dtype
    for chunk in chunks:
        chunk.to(dtype)
    fill_chunks(chunks, source, tp_rank, tp)


def convert(load_dir: str, save_dir: str, tp: int, pp: int, fmt: str, say: Say = print) -> str:
    """Convert the latest checkpoint of `load_dir` to TP x PP in format `fmt` under
    `save_dir` (its tracker pointing at it). Returns the written iteration directory."""
    directory, iteration = resolve(load_dir)
    say(f" reading {directory} (model weights only: the optimizer state is dropped)")
    source = read_source(directory, say)
    return write_source(source, save_dir, tp, pp, fmt, iteration, say)


def write_source(
    source: Source, save_dir: str, tp: int, pp: int, fmt: str, iteration: int = 0, say: Say = print
) -> str:
    """Write the full tensors of `source` as a megapipe checkpoint at TP x PP in format `fmt`
    (model weights only), then point `save_dir`'s tracker at it."""
    ranges = check_target(source.config, tp, pp)
    args = target_args(source.args, tp, pp, fmt)
    layout = {
        "world_size": tp * pp,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": 1,
    }
    target = os.path.abspath(iteration_dir(save_dir, iteration))
    namespace = converted_namespace(
        args,
        source.config,
        layout,
        iteration=source.progress.iteration,
        consumed_train_samples=source.progress.consumed_samples,
    )
    if fmt == "torch_dist":
        shards: ShardedState = {}
        objects: dict[str, bytes] = {}
        layers, stacked = source.config.num_layers, stacks_layers(source.config)
        for p in range(pp):
            for t in range(tp):
                chunks = build_rank(source.config, t, tp, p, [ranges[p]], pp)
                _fill(chunks, source, t, tp)
                named = _named(chunks)
                for name, pieces in model_shards(named, t, tp, layers, stacked=stacked).items():
                    shards.setdefault(name, []).extend(pieces)
                objects.update(extra_state_entries(layer_mlps(named), layers, stacked=stacked))
                say(f" built TP rank {t} PP rank {p}")
        common = {
            "checkpoint_version": CHECKPOINT_VERSION,
            **source.progress.as_dict(),
            "optimizer_step": 0,
            "has_optimizer": False,
            "has_rng": False,
            "loss_scaler": {},
            "layout": layout,
            "args": namespace,
            "megapipe_args": args,
            "true_vocab_size": source.config.vocab_size,
        }
        save_sharded(target, shards, common, group=None, coordinator=True, objects=objects)
    else:
        _write_legacy(source, target, tp, pp, ranges, args, namespace, layout, say)
    write_tracker(save_dir, iteration)
    say(f" wrote {target} (TP {tp} x PP {pp}, {fmt}); tracker at iteration {iteration}")
    return target


def _write_legacy(
    source: Source,
    target: str,
    tp: int,
    pp: int,
    ranges: list[range],
    args: dict[str, str],
    namespace: argparse.Namespace,
    layout: dict[str, int],
    say: Say,
) -> None:
    temp = legacy.start_directory(target)
    try:
        tables: dict[str, dict[str, dict]] = {}
        for p in range(pp):
            for t in range(tp):
                chunks = build_rank(source.config, t, tp, p, [ranges[p]], pp)
                _fill(chunks, source, t, tp)
                sub = legacy.mp_rank_name(t, p, pp)
                os.mkdir(os.path.join(temp, sub))
                data = {
                    "model": legacy.chunk_state(chunks[0]),
                    **legacy.common_entries(
                        source.progress,
                        args,
                        layout,
                        [[ranges[p].start, ranges[p].stop]],
                        source.config.vocab_size,
                        namespace,
                    ),
                }
                legacy.write_file(os.path.join(temp, sub, legacy.MODEL_FILE), data)
                tables[sub] = atomic_dir.fsync_and_digest(
                    os.path.join(temp, sub), [legacy.MODEL_FILE]
                )
                say(f" wrote {sub}/{legacy.MODEL_FILE}")
        legacy.finish_directory(temp, target, tables)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
