"""Model and optimizer state as pieces of layout-free logical tensors, and back.

Every parameter is described globally by its `ParamMeta` (full shape, the dimension TP splits,
SwiGLU's stride, the real vocabulary rows of a padded embedding, whether EP splits its
experts) and its global name. This module turns a rank's TP-local (and EP-local) tensors, and
its fp32 masters and Adam moments (whole or, with the distributed optimizer, a flat range of
them), into `TensorShard`s of logical tensors whose names and shapes are the same for every
layout (`regions` maps local data to global blocks):

- names follow Megatron-Core's `torch_dist` checkpoints: transformer layers are *stacked* (the
  layer index is a leading axis: `decoder.layers.mlp.linear_fc1.weight` of shape
  [num_layers, ...]) and the norms take TransformerEngine's fused names
  (`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`). MoE layers
  follow Megatron-Core's SequentialMLP: `mlp.router.weight` [E, h], `mlp.router.expert_bias`
  [E] (a buffer), the stacked experts as `mlp.experts.experts.linear_fc1.weight` [E, fc1, h]
  (`linear_fc2.weight` [E, h, ffn], `.bias` alike), `mlp.shared_experts.*` as a dense MLP;
  with MoE on only some layers, no layer is stacked (`stacks_layers`: every layer has its own
  keys `decoder.layers.<i>.<name>`, as Megatron-Core's non-homogeneous layers);
- the vocabulary tensors (`embedding.word_embeddings.weight`, `output_layer.weight` and their
  optimizer states) are written with the saving run's padded rows, as Megatron-LM builds its
  model (`padded_vocab_size` rows), so Megatron-Core loads them as they are. The padding depends
  on TP, so loads read the first `vocab_size` rows only (the real ones) of a checkpoint with
  any number of rows at least that: `fit_vocabulary` aims the destinations at the checkpoint's
  row count, and every loader passes it to `torch_dist.load_sharded(..., fit=fit_vocabulary)`
  (checkpoints without padding load alike);
- Megatron-Core's `_extra_state` byte entries of its local spec (one per linear layer and
  layer index: `torch.save([None])`, the value of `get_extra_state()`) are written beside them
  (`extra_state_entries`) and never read back;
- optimizer state is stored per parameter in that same global shape, under
  `optimizer.state.{exp_avg,exp_avg_sq,fp32_param,momentum_buffer}.<name>`, never as flat
  distributed-optimizer buffers, so it reshards exactly like the weights.

A mirrored parameter (the last stage's copy of a tied word embedding) is not saved: it loads
from the logical tensor it mirrors. The same functions serve saving (the shards are views of
the live tensors) and loading (the same views are the destinations, filled in place).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.extra_state import EXTRA_STATE_SITES, extra_state_entries
from megapipe.checkpointing.regions import Region, regions
from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.config import ModelConfig
from megapipe.distributed.fsdp import local_part
from megapipe.layers.param_meta import ParamMeta

__all__ = ["EXTRA_STATE_SITES", "Region", "extra_state_entries", "regions"]  # re-exported

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megapipe's per-layer names -> Megatron-Core's: TransformerEngine-fused norms (MoE layers
# too), and the stacked experts as SequentialMLP's `experts.experts.*` with an expert axis
_LAYER_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.experts.weight1": "mlp.experts.experts.linear_fc1.weight",
    "mlp.experts.weight2": "mlp.experts.experts.linear_fc2.weight",
    "mlp.experts.bias1": "mlp.experts.experts.linear_fc1.bias",
    "mlp.experts.bias2": "mlp.experts.experts.linear_fc2.bias",
}
# checkpointed buffers (no parameters): the router's expert bias, as Megatron-Core keeps it
EXPERT_BIAS = "mlp.router.expert_bias"
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")
# logical tensors with vocabulary rows (padded to the saving layout's padded_vocab_size)
VOCABULARY = ("embedding.word_embeddings.weight", "output_layer.weight")


def stacks_layers(config: ModelConfig) -> bool:
    """Whether the checkpoint stacks the layers (a leading layer axis), as Megatron-Core does
    unless the layers differ: with MoE on only some layers (`--moe-layer-freq` above 1, or a
    list) every layer has its own keys, `decoder.layers.<i>.<name>`."""
    return config.moe is None or config.moe.moe_layer_freq == 1


def logical_name(name: str, stacked: bool = True) -> tuple[str, int | None]:
    """(logical name, layer index to stack on or None) of a global parameter name."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    rest = _LAYER_NAMES.get(match.group(2), match.group(2))
    if not stacked:
        return f"decoder.layers.{match.group(1)}.{rest}", None
    return f"decoder.layers.{rest}", int(match.group(1))


def checkpointed_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's tensors that checkpoints hold: its parameters, and its routers' expert
    biases (buffers that are not in its state dict, updated outside the optimizer)."""
    named: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    for name, buffer in module.named_buffers():
        if name.endswith(EXPERT_BIAS) and buffer is not None:
            named.append((name, buffer))
    return named


def _meta(tensor: torch.Tensor) -> ParamMeta:
    """A parameter's meta; a buffer is a replicated tensor of its own shape."""
    meta = getattr(tensor, "meta", None)
    return meta if meta is not None else ParamMeta(tuple(tensor.shape))


def global_shape(meta: ParamMeta, *, real_rows_only: bool = False) -> tuple[int, ...]:
    """The logical shape: the full (padded) shape, or without its vocabulary padding."""
    shape = list(meta.full_shape)
    if real_rows_only and meta.init_rows is not None:
        shape[0] = meta.init_rows
    return tuple(shape)


def is_vocabulary(key: str) -> bool:
    """Whether a logical tensor (a weight or its optimizer state) has vocabulary rows."""
    if key.startswith("optimizer.state."):
        key = key.split(".", 3)[-1]  # optimizer.state.<kind>.<name>
    return key in VOCABULARY


def fit_vocabulary(
    shards: ShardedState, saved: Mapping[str, Sequence[int]], where: str
) -> ShardedState:
    """Load destinations (`model_shards`/`optimizer_shards` with loading=True: the real rows
    only) re-aimed at the row count of the checkpoint's vocabulary tensors, whatever padding
    the saving layout had: `saved` is the checkpoint's global shape of each tensor (as
    `torch_dist.load_sharded` hands it to its `fit`, agreeing the errors). A checkpoint with
    fewer rows than the model's vocabulary is a CheckpointError; tensors it lacks are left for
    the load to report."""
    out: ShardedState = {}
    for key, pieces in shards.items():
        held = saved.get(key)
        if not is_vocabulary(key) or held is None or not pieces:
            out[key] = pieces
            continue
        wanted = pieces[0].global_shape
        if len(held) != len(wanted):
            out[key] = pieces  # the load names the mismatch
            continue
        if held[0] < wanted[0]:
            raise CheckpointError(
                f"checkpoint {where}: tensor {key} has {held[0]} vocabulary rows, fewer than "
                f"this model's vocabulary of {wanted[0]}"
            )
        # (another hidden size is left for the load to name, the rows then agreeing)
        out[key] = [replace(p, global_shape=(held[0], *wanted[1:])) for p in pieces]
    return out


def saved_vocab_size(common: Mapping[str, object], saved: Mapping[str, Sequence[int]]) -> int:
    """The real vocabulary of a torch_dist checkpoint: common.pt's `true_vocab_size`, or the
    word embedding's rows when it has none (megapipe checkpoints before vocabulary padding was
    saved)."""
    true_size = common.get("true_vocab_size")
    if isinstance(true_size, int):
        return true_size
    return int(saved[VOCABULARY[0]][0])


@dataclass(frozen=True)
class Placement:
    """Where a rank's tensors sit: its TP and EP ranks, and how layers are named."""

    tp_rank: int
    tp_size: int
    num_layers: int
    ep_rank: int = 0
    ep_size: int = 1
    stacked: bool = True


def _shards_of(
    flat: torch.Tensor,
    name: str,
    meta: ParamMeta,
    where: Placement,
    local_shape: Sequence[int],
    lo: int,
    loading: bool,
) -> tuple[str, list[TensorShard]]:
    key, layer = logical_name(name, where.stacked)
    shape = global_shape(meta, real_rows_only=loading)
    shards = []
    found = regions(
        meta,
        where.tp_rank,
        where.tp_size,
        local_shape,
        lo,
        lo + flat.numel(),
        real_rows_only=loading,
        ep_rank=where.ep_rank,
        ep_size=where.ep_size,
    )
    for region in found:
        start = region.flat_start - lo
        view = flat[start : start + math.prod(region.shape)].view(region.shape)
        offsets, full = region.offsets, shape
        if layer is not None:
            view, offsets = view.unsqueeze(0), (layer, *offsets)
            full = (where.num_layers, *shape)
        shards.append(TensorShard(view, offsets, full))
    return key, shards


def _add(state: ShardedState, key: str, shards: list[TensorShard]) -> None:
    state.setdefault(key, []).extend(shards)


def _wanted(meta: ParamMeta, tp_rank: int, loading: bool) -> bool:
    """Saving writes each element once: no mirrors, TP replicas from TP rank 0 only. Loading
    fills every local tensor, mirrors and replicas included."""
    return loading or (meta.copy_of is None and (meta.is_tensor_parallel or tp_rank == 0))


def model_shards(
    named_params: Sequence[tuple[str, torch.Tensor]],
    tp_rank: int,
    tp_size: int,
    num_layers: int,
    *,
    loading: bool = False,
    dtype: torch.dtype | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    stacked: bool = True,
) -> ShardedState:
    """Views of this rank's parameters as pieces of the logical tensors: the pieces to write
    (each element once over the TP group, vocabulary padding included), or with `loading` the
    destinations to fill in place (mirrors read the tensor they mirror; the real vocabulary
    rows only, their global shape unpadded until `fit_vocabulary` sets the checkpoint's). An
    FSDP2 parameter gives the rows it holds. Expert parameters (`meta.expert_parallel`) are
    the EP rank's block of experts; buffers (`checkpointed_tensors`) are replicated tensors.
    `dtype` (saving only): write parameters' copies in this dtype (FSDP2's fp32 shards of a
    bf16 run). `stacked`: `stacks_layers` of the model."""
    where = Placement(tp_rank, tp_size, num_layers, ep_rank, ep_size, stacked)
    state: ShardedState = {}
    for name, param in named_params:
        meta = _meta(param)
        if not _wanted(meta, tp_rank, loading):
            continue
        source = meta.copy_of or name
        flat, lo = local_part(param)
        if dtype is not None and not loading and isinstance(param, torch.nn.Parameter):
            flat = flat.to(dtype)
        key, shards = _shards_of(flat, source, meta, where, param.shape, lo, loading)
        _add(state, key, shards)
    return state


def optimizer_shards(
    pieces: Sequence[tuple[str, torch.nn.Parameter, int, torch.Tensor, dict[str, torch.Tensor]]],
    tp_rank: int,
    tp_size: int,
    num_layers: int,
    *,
    include_masters: bool,
    loading: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
    stacked: bool = True,
) -> ShardedState:
    """The optimizer's per-parameter state as pieces of logical tensors.

    `pieces`: (global name, parameter, flat start within the parameter, fp32 master slice,
    the optimizer's state tensors of that slice by name). Masters are included only when they
    are not the parameters themselves (bf16/fp16 training). The rest as in model_shards."""
    where = Placement(tp_rank, tp_size, num_layers, ep_rank, ep_size, stacked)
    state: ShardedState = {}
    for name, param, lo, master, moments in pieces:
        meta: ParamMeta = param.meta
        if not _wanted(meta, tp_rank, loading):
            continue
        source = meta.copy_of or name
        tensors = dict(moments)
        if include_masters:
            tensors["fp32_param"] = master
        for kind, tensor in tensors.items():
            key, shards = _shards_of(tensor.view(-1), source, meta, where, param.shape, lo, loading)
            _add(state, f"optimizer.state.{kind}.{key}", shards)
    return state
