"""Model and optimizer state as pieces of layout-free logical tensors, and back.

Every parameter is described globally by its `ParamMeta` (full shape, the dimension TP splits,
SwiGLU's stride, the real vocabulary rows of a padded embedding) and its global name. This
module turns a rank's TP-local tensors, and its fp32 masters and Adam moments (whole or, with the
distributed optimizer, a flat range of them), into `TensorShard`s of logical tensors whose names
and shapes are the same for every layout:

- names follow Megatron-Core's `torch_dist` checkpoints: transformer layers are *stacked* (the
  layer index is a leading axis: `decoder.layers.mlp.linear_fc1.weight` of shape
  [num_layers, ...]) and the norms take TransformerEngine's fused names
  (`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`);
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

import io
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.distributed.fsdp import local_part
from megapipe.layers.param_meta import ParamMeta

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megapipe's per-layer names -> Megatron-Core's (TransformerEngine-fused norms)
_NORM_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")
# logical tensors with vocabulary rows (padded to the saving layout's padded_vocab_size)
VOCABULARY = ("embedding.word_embeddings.weight", "output_layer.weight")
# the linears of Megatron-Core's layer spec: one `_extra_state` entry each per layer
EXTRA_STATE_SITES = (
    "self_attention.linear_proj",
    "self_attention.linear_qkv",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


def logical_name(name: str) -> tuple[str, int | None]:
    """(stacked logical name, layer index or None) of a global parameter name."""
    match = _LAYER.match(name)
    if match is None:
        return name, None
    rest = match.group(2)
    return f"decoder.layers.{_NORM_NAMES.get(rest, rest)}", int(match.group(1))


@dataclass(frozen=True)
class _Region:
    """A contiguous run [flat_start, flat_start + numel) of a local tensor's flat data that is
    the rectangular block `shape` at `offsets` of the (unstacked) global tensor."""

    flat_start: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _rows_of_flat_range(lo: int, hi: int, columns: int) -> Iterator[tuple[int, int, int, int]]:
    """A flat range of a [rows, columns] tensor as (flat_start, row, first_col, ncols) for
    partial rows and (flat_start, row, 0, -nrows) for a run of whole rows."""
    row, col = divmod(lo, columns)
    if col:
        end = min(hi, (row + 1) * columns)
        yield lo, row, col, end - lo
        lo, row = end, row + 1
    whole = (hi - lo) // columns
    if whole:
        yield lo, row, 0, -whole
        lo, row = lo + whole * columns, row + whole
    if lo < hi:
        yield lo, row, 0, hi - lo


def _global_rows(meta: ParamMeta, tp_rank: int, tp_size: int, local_rows: int, row: int, n: int):
    """Split local rows [row, row + n) into runs that are contiguous globally (SwiGLU's two
    blocks map apart): yields (local row, global row, count)."""
    if meta.tp_dim != 0 or tp_size == 1:
        yield row, row, n
        return
    block = local_rows // meta.tp_stride  # local rows per stride block
    full_block = meta.full_shape[0] // meta.tp_stride
    while n > 0:
        b, within = divmod(row, block)
        count = min(n, block - within)
        yield row, b * full_block + tp_rank * block + within, count
        row, n = row + count, n - count


def regions(
    meta: ParamMeta,
    tp_rank: int,
    tp_size: int,
    local_shape: Sequence[int],
    lo: int,
    hi: int,
    *,
    real_rows_only: bool = False,
) -> list[_Region]:
    """The global blocks that the flat range [lo, hi) of a TP-local tensor covers (of the
    padded global tensor; with `real_rows_only`, without its vocabulary padding rows)."""
    if len(local_shape) not in (1, 2):
        raise ValueError(f"parameters are 1-D or 2-D, got shape {tuple(local_shape)}")
    two_d = len(local_shape) == 2
    rows, columns = local_shape[0], (local_shape[1] if two_d else 1)
    column_offset = tp_rank * columns if meta.tp_dim == 1 and tp_size > 1 else 0
    real_rows = meta.full_shape[0]
    if real_rows_only and meta.init_rows is not None:
        real_rows = meta.init_rows
    out: list[_Region] = []
    for flat, row, col, ncols in _rows_of_flat_range(lo, hi, columns):
        nrows, width = (-ncols, columns) if ncols < 0 else (1, ncols)
        for local_row, global_row, count in _global_rows(meta, tp_rank, tp_size, rows, row, nrows):
            count = min(count, real_rows - global_row)  # padding rows, when dropped
            if count <= 0:
                continue
            start = flat + (local_row - row) * columns
            if two_d:
                out.append(_Region(start, (count, width), (global_row, column_offset + col)))
            else:
                out.append(_Region(start, (count * width,), (global_row,)))
    return out


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


def extra_state_entries(layers: Iterable[int], num_layers: int) -> dict[str, bytes]:
    """Megatron-Core's `_extra_state` entries of the given (global) layer indices, as its
    local spec writes them: `torch.save([None])` (its linears' get_extra_state() is None, and
    it saves the list of a ShardedObject's data) under
    `decoder.layers.<site>._extra_state/shard_<layer>_<num_layers>`. TransformerEngine's FP8
    scaling state is not kept: a TE model loading None keeps its own (TE's set_extra_state
    accepts None)."""
    buffer = io.BytesIO()
    torch.save([None], buffer)
    data = buffer.getvalue()
    return {
        f"decoder.layers.{site}._extra_state/shard_{layer}_{num_layers}": data
        for layer in sorted(set(layers))
        for site in EXTRA_STATE_SITES
    }


def _shards_of(
    flat: torch.Tensor,
    name: str,
    meta: ParamMeta,
    tp_rank: int,
    tp_size: int,
    local_shape: Sequence[int],
    lo: int,
    num_layers: int,
    loading: bool,
) -> tuple[str, list[TensorShard]]:
    key, layer = logical_name(name)
    shape = global_shape(meta, real_rows_only=loading)
    shards = []
    hi = lo + flat.numel()
    for region in regions(meta, tp_rank, tp_size, local_shape, lo, hi, real_rows_only=loading):
        numel = 1
        for size in region.shape:
            numel *= size
        start = region.flat_start - lo
        view = flat[start : start + numel].view(region.shape)
        offsets, full = region.offsets, shape
        if layer is not None:
            view, offsets, full = view.unsqueeze(0), (layer, *offsets), (num_layers, *shape)
        shards.append(TensorShard(view, offsets, full))
    return key, shards


def _add(state: ShardedState, key: str, shards: list[TensorShard]) -> None:
    state.setdefault(key, []).extend(shards)


def _wanted(meta: ParamMeta, tp_rank: int, loading: bool) -> bool:
    """Saving writes each element once: no mirrors, TP replicas from TP rank 0 only. Loading
    fills every local tensor, mirrors and replicas included."""
    return loading or (meta.copy_of is None and (meta.is_tensor_parallel or tp_rank == 0))


def model_shards(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    tp_rank: int,
    tp_size: int,
    num_layers: int,
    *,
    loading: bool = False,
    dtype: torch.dtype | None = None,
) -> ShardedState:
    """Views of this rank's parameters as pieces of the logical tensors: the pieces to write
    (each element once over the TP group, vocabulary padding included), or with `loading` the
    destinations to fill in place (mirrors read the tensor they mirror; the real vocabulary
    rows only, their global shape unpadded until `fit_vocabulary` sets the checkpoint's). An
    FSDP2 parameter gives the rows it holds.
    `dtype` (saving only): write copies in this dtype (FSDP2's fp32 shards of a bf16 run)."""
    state: ShardedState = {}
    for name, param in named_params:
        meta: ParamMeta = param.meta
        if not _wanted(meta, tp_rank, loading):
            continue
        source = meta.copy_of or name
        flat, lo = local_part(param)
        if dtype is not None and not loading:
            flat = flat.to(dtype)
        key, shards = _shards_of(
            flat, source, meta, tp_rank, tp_size, param.shape, lo, num_layers, loading
        )
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
) -> ShardedState:
    """The optimizer's per-parameter state as pieces of logical tensors.

    `pieces`: (global name, parameter, flat start within the parameter, fp32 master slice,
    the optimizer's state tensors of that slice by name). Masters are included only when they
    are not the parameters themselves (bf16/fp16 training). `loading` as in model_shards."""
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
            flat = tensor.view(-1)
            key, shards = _shards_of(
                flat, source, meta, tp_rank, tp_size, param.shape, lo, num_layers, loading
            )
            _add(state, f"optimizer.state.{kind}.{key}", shards)
    return state
