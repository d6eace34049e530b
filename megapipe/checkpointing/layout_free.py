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
- vocabulary padding is cut off (the padded rows depend on TP), so an embedding is
  [vocab_size, hidden] whatever the layout;
- optimizer state is stored per parameter in that same global shape, under
  `optimizer.state.{exp_avg,exp_avg_sq,fp32_param,momentum_buffer}.<name>`, never as flat
  distributed-optimizer buffers, so it reshards exactly like the weights.

A mirrored parameter (the last stage's copy of a tied word embedding) is not saved: it loads
from the logical tensor it mirrors. The same functions serve saving (the shards are views of
the live tensors) and loading (the same views are the destinations, filled in place).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

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
    the rectangular block `shape` at `offsets` of the (unpadded, unstacked) global tensor."""

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
    meta: ParamMeta, tp_rank: int, tp_size: int, local_shape: Sequence[int], lo: int, hi: int
) -> list[_Region]:
    """The global blocks that the flat range [lo, hi) of a TP-local tensor covers."""
    if len(local_shape) not in (1, 2):
        raise ValueError(f"parameters are 1-D or 2-D, got shape {tuple(local_shape)}")
    two_d = len(local_shape) == 2
    rows, columns = local_shape[0], (local_shape[1] if two_d else 1)
    column_offset = tp_rank * columns if meta.tp_dim == 1 and tp_size > 1 else 0
    real_rows = meta.init_rows if meta.init_rows is not None else meta.full_shape[0]
    out: list[_Region] = []
    for flat, row, col, ncols in _rows_of_flat_range(lo, hi, columns):
        nrows, width = (-ncols, columns) if ncols < 0 else (1, ncols)
        for local_row, global_row, count in _global_rows(meta, tp_rank, tp_size, rows, row, nrows):
            count = min(count, real_rows - global_row)  # padded vocabulary rows are dropped
            if count <= 0:
                continue
            start = flat + (local_row - row) * columns
            if two_d:
                out.append(_Region(start, (count, width), (global_row, column_offset + col)))
            else:
                out.append(_Region(start, (count * width,), (global_row,)))
    return out


def global_shape(meta: ParamMeta) -> tuple[int, ...]:
    """The logical shape: the full shape without vocabulary padding."""
    shape = list(meta.full_shape)
    if meta.init_rows is not None:
        shape[0] = meta.init_rows
    return tuple(shape)


def _shards_of(
    flat: torch.Tensor,
    name: str,
    meta: ParamMeta,
    tp_rank: int,
    tp_size: int,
    local_shape: Sequence[int],
    lo: int,
    num_layers: int,
) -> tuple[str, list[TensorShard]]:
    key, layer = logical_name(name)
    shape = global_shape(meta)
    shards = []
    for region in regions(meta, tp_rank, tp_size, local_shape, lo, lo + flat.numel()):
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
    (each element once over the TP group), or with `loading` the destinations to fill in
    place (mirrors read the tensor they mirror). An FSDP2 parameter gives the rows it holds.
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
        key, shards = _shards_of(flat, source, meta, tp_rank, tp_size, param.shape, lo, num_layers)
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
            key, shards = _shards_of(
                tensor.view(-1), source, meta, tp_rank, tp_size, param.shape, lo, num_layers
            )
            _add(state, f"optimizer.state.{kind}.{key}", shards)
    return state
